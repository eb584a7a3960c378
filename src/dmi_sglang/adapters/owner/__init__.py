"""The store owner's channels: other processes read and write the embedded store through
the process that holds it (the embedded engine admits one process per store).

:class:`ReadService` answers :class:`~dmi_sglang.domain.ports.RecordReader` calls on an
IPC socket, on its own thread of the owner; :class:`RemoteReader` is the reader the other
process uses (see :mod:`._reads`). :class:`SinkService` takes
:class:`~dmi_sglang.columns.RecordSink` calls the same way, so several processes (the
ranks of a tensor-parallel run) write one run; :class:`RemoteSink` is their sink (see
:mod:`._writes`).
"""

from dmi_sglang.adapters.owner._reads import READ_TIMEOUT_S, ReadService, RemoteReader
from dmi_sglang.adapters.owner._service import check_address
from dmi_sglang.adapters.owner._writes import (
    PUT_PIECE_BYTES,
    WRITE_TIMEOUT_S,
    RemoteSink,
    SinkService,
)

__all__ = ["PUT_PIECE_BYTES", "READ_TIMEOUT_S", "WRITE_TIMEOUT_S", "ReadService",
           "RemoteReader", "RemoteSink", "SinkService", "check_address"]
