"""laminar_examples: what Laminar's example jobs are made of, kept out of the libraries.

- :mod:`.tasks`: the demo's synthetic tasks (sort, reverse, add, repeat) with verifiable
  rewards, their prompt records, held-out split and scoring (the ``synthetic`` reward);
- :mod:`.math_tasks`: the math example's word problems as a verl parquet;
- :mod:`.demo_model`, :mod:`.warmstart`, :mod:`.accuracy`: the demo's character-level
  tokenizer and tiny Llama, its supervised warm start and held-out accuracy;
- :mod:`.chat_model`, :mod:`.chat_warmstart`: the math example's Qwen2-shaped chat model
  and its warm start;
- :mod:`.cli`: ``laminar-examples prompts | warmstart | warmstart-chat``, the set-up steps
  of the job files in ``examples/``.

The tasks, the math problems and the CLI import laminar-common only; the models and warm
starts need torch and transformers (``pip install 'laminar-examples[train]'``), imported
only by the modules that use them. No library package imports this one.
"""

from .version import __version__

__all__ = ["__version__"]
