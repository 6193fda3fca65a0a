"""verl's command lines in hybridrl: the key table and the override translation (pure).

Contract:
- ``keys``: ``VERL_RULES`` / ``VERL_KEYS``, one checked rule per verl key (set, ignore, refuse,
  same, world, special) and ``rule_for(key)``.
- ``translate``: ``translate_overrides(items)`` -> ``Translation`` (hybridrl overrides, refusals,
  one notice line, the checks that need the loaded config or the world size).
``hybridrl.config.loader`` applies them; nothing here reads files or builds a config. Imports only
the schema below it (``hybridrl.config.trainer``). docs/from_verl.md is the user's guide.
"""
