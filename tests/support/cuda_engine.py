"""An engine that says it was built with CUDA, for tests on machines without a GPU: the node
agent runs it in place of llama-server (a script named by --llama-server runs this file with
llama-server's arguments).

- ``--list-devices`` answers as a CUDA build of llama-server does on a machine with
  $LLMGW_FAKE_CUDA_DEVICES (default 2) GPUs, so the agent reports the CUDA backend.
- Anything else: it writes its argv and the CUDA variables of its environment as JSON to
  $LLMGW_FAKE_ENGINE_RECORD (when set), prints the offload line a CUDA build prints when
  $LLMGW_FAKE_OFFLOADED is "N/M", then becomes the real (CPU) llama-server ($LLMGW_REAL_LLAMA_SERVER)
  with the same arguments, which accepts them and serves on the CPU. So what is real: the agent,
  its command line and environment, the engine serving; what is not: the GPU.

    python tests/support/cuda_engine.py --list-devices
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> None:
    if argv == ["--list-devices"]:
        count = int(os.environ.get("LLMGW_FAKE_CUDA_DEVICES", "2"))
        print(f"ggml_cuda_init: found {count} CUDA devices (Total VRAM: {count * 81079} MiB):")
        print("Available devices:")
        for index in range(count):
            print(f"  CUDA{index}: NVIDIA H100 80GB HBM3 (81079 MiB, 80520 MiB free)")
        return
    record = os.environ.get("LLMGW_FAKE_ENGINE_RECORD")
    if record:
        with open(record, "w") as out:
            json.dump(
                {
                    "argv": argv,
                    "env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_")},
                },
                out,
            )
    offloaded = os.environ.get("LLMGW_FAKE_OFFLOADED")
    if offloaded:
        print(f"load_tensors: offloaded {offloaded} layers to GPU", flush=True)
        print("load_tensors:        CUDA0 model buffer size =     2.50 MiB", flush=True)
    real = os.environ["LLMGW_REAL_LLAMA_SERVER"]
    os.execv(real, [real, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
