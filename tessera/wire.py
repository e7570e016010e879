"""Constants of the wire shared by the daemons and the client (no imports: the CLI and
every service may import this without pulling in anything else)."""

from __future__ import annotations

# Message limits (both ways) for a service whose calls may carry large batches (the
# estimator's EstimateBatch at its MAX_BATCH) or large replies (the controller's
# GetJobLogs): gRPC's default receive limit is 4 MiB. Servers pass them to
# ``grpcserver.start``/``serve``; their clients' channels take the same options.
MAX_MESSAGE_BYTES = 64 << 20
LARGE_MESSAGES = (("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES))

# The largest log tail one node's ReadLogs returns, and so GetJobLogs' largest
# ``tail_bytes`` (the controller's bound and the agent's).
MAX_LOG_TAIL_BYTES = 4 << 20

# WatchJobs' initial-metadata key: the controller sends it as soon as it accepts a watch,
# so that a client knows the call connected even when no event follows (a quiet job).
WATCH_OPEN_METADATA_KEY = "tessera-watch-open"
