"""Datasets, chat templates and rewards: what a job's data means, shared by the tiers.

- :mod:`.records`: reading JSONL / parquet datasets into :class:`~.records.Record`
  (text or chat-message prompts, dot-path keys, stable ids, nested metadata).
- :mod:`.chat`: turning a record's prompt into token ids with a tokenizer's chat
  template, identically in the rollout worker and in the trainer.
- :mod:`.rewards`: the reward function contract ``fn(prompt, completion, metadata)``,
  the built-ins (``math`` on math-verify, ``gsm8k``, ``exact``) and ``module:function``
  loading.
- :mod:`.provenance`: step records, what each trainer step trained on (Parquet), read
  back for ``laminar samples`` and ``laminar replay``.

Part of laminar-common's layout: it imports the core only, never ``relay``,
``launch`` or ``consume``.
"""
