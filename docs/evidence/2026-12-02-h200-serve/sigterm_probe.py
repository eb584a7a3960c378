"""Does SGLang 0.5.19's HTTP server exit after SIGTERM, stock and with dmi-sglang serve?

Starts the server (stock: ``python -m sglang.launch_server``; monitored: ``python -m
dmi_sglang serve``) on a generated 4-layer Qwen3 checkpoint, sends one request, sends
SIGTERM and waits up to 60 s; a server still running is dumped with py-spy, then killed.
Prints one JSON line per server. Usage: python sigterm_probe.py OUTDIR
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch",
         "--mem-fraction-static", "0.3", "--cuda-graph-max-bs-decode", "16",
         "--log-level", "info"]


def probe(out: Path, name: str, model: Path, monitored: bool) -> dict[str, object]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    head = ([sys.executable, "-m", "dmi_sglang", "serve", "--run-id", name, "--db",
             f"chdb://{out / 'store'}"] if monitored
            else [sys.executable, "-m", "sglang.launch_server"])
    argv = [*head, "--model-path", str(model), "--port", str(port), "--host", "127.0.0.1",
            *FLAGS]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMX_")}
    log = out / f"{name}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 300:
        try:
            body = json.dumps({"text": "w1 w2", "sampling_params": {"max_new_tokens": 4}})
            req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                if resp.status == 200:
                    break
        except OSError:
            time.sleep(2)
    started = time.monotonic() - t0
    t1 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
        exited: float | None = time.monotonic() - t1
    except subprocess.TimeoutExpired:
        exited = None
        dump = subprocess.run(["py-spy", "dump", "--pid", str(proc.pid)], capture_output=True,
                              text=True, check=False)
        (out / f"{name}-py-spy.txt").write_text(dump.stdout + dump.stderr)
        proc.kill()
        proc.wait()
    return {"server": name, "start_s": round(started, 1),
            "exit_after_sigterm_s": None if exited is None else round(exited, 1),
            "returncode": proc.returncode}


if __name__ == "__main__":
    outdir = Path(sys.argv[1])
    outdir.mkdir(parents=True, exist_ok=True)
    from dmi_sglang.adapters.demo_model import write_demo_checkpoint

    ckpt = Path(write_demo_checkpoint(outdir / "qwen3-demo", layers=4))
    for name, monitored in (("stock", False), ("monitored", True)):
        print(json.dumps(probe(outdir, name, ckpt, monitored)), flush=True)
