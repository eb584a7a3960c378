"""The original integration's DMIEngine example, with only the import changed.

On our machines the model is a generated checkpoint and the store is the embedded
default (no dmx_db_host)::

    python examples/dmi_engine_example.py [MODEL_DIR]
"""

import sys

from dmi_sglang import DMIEngine

if __name__ == "__main__":
    model_path = sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen3-0.6B"
    engine = DMIEngine(
        model_path=model_path,
        mem_fraction_static=0.5,
        disable_prefill_cuda_graph=True,
        dmx_model_id="my-run",
        dmx_hook_selection="resid_pre,final_ln,token_ids,final_logits",
        dmx_ring_payload_mb=1024,
        dmx_ring_pinned_mb=1024,
        attention_backend="triton",  # the backend qualification ran on (docs/gpu.md)
    )
    try:
        outputs = engine.generate(
            prompt=["The capital of France is"],
            sampling_params={"temperature": 0, "max_new_tokens": 8},
            rid=["request-0"],
        )
        engine.dmi_stop_monitoring()  # authoritative flush
        print(outputs[0]["text"], outputs[0]["dmi_internal"].available)
        hidden = outputs[0]["dmi_internal"].hidden_states
        print(f"hidden_states: {len(hidden)} layers, each {tuple(hidden[0].shape)}")
    finally:
        engine.shutdown()
