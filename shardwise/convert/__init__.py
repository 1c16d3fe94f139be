"""`shardwise convert`: a run directory <-> a Hugging Face `transformers` checkpoint (`hf.py`), and a
LoRA run's adapters -> a PEFT adapter (`peft.py`)."""

from shardwise.convert.hf import (check_out_dir, copy_atomic, copy_chat_template, export_run_to_hf, family_of_hf,
                                  import_hf_to_run)
from shardwise.convert.peft import export_run_to_peft

__all__ = ["check_out_dir", "copy_atomic", "copy_chat_template", "export_run_to_hf", "export_run_to_peft",
           "family_of_hf", "import_hf_to_run"]
