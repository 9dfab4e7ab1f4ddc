"""A torchrun worker for `titan simulate failures --measure`: it joins its process group, notes when, and on
torchrun's first attempt dies, so that the agent restarts it."""

import json
import os
import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with open(sys.argv[1], "a") as log:
    log.write(json.dumps({"attempt": attempt, "joined": time.time(), "died": time.time()}) + "\n")
if attempt == 0:
    os._exit(1)  # as a killed worker: no clean shutdown
dist.destroy_process_group()
