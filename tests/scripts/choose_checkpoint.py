"""Each rank finds a different newest checkpoint (as when one completes while processes start); every rank
must resume from the main process's choice. Rank R writes OUT/chosen_R.json.

Launched by the tests with accelerate launch or torchrun.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from finetune.config import parse_config
from finetune.loop import _main_process_choice
from finetune.runtimes.launcher import make_runtime


@dataclass
class NoOptions:
    pass


out = Path(sys.argv[1])
cfg, _ = parse_config(NoOptions, sys.argv[2:])
with make_runtime(cfg, tracking=None) as runtime:
    seen = out / "checkpoints" / ("step_4" if runtime.rank == 0 else "step_8")
    chosen = _main_process_choice(runtime, seen, str(out))
    (out / f"chosen_{runtime.rank}.json").write_text(json.dumps(str(chosen)))
