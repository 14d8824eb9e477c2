"""ztrain: the `z train` recipe as a library, a small GPT or Mixtral-style LM trained on
Shakespeare's plays over zcore's engine.

Modules, each importable alone (the engine itself lives in `zcore`):
`data` (corpus, splits, token windows), `tokenizer` (byte-level BPE),
`gpt` (the model), `moe_lm` (`--moe`: the Mixtral-architecture LM and its dense twin),
`moe_plan` (the `--moe` flags checked, the model built from a plan or a `model.json`),
`moe_metrics` (aux loss, dropped tokens, expert load per step), `mixtral_export`
(`z export-mixtral`), `generate` (sampling, export directory), `metrics`
(JSON Lines, loss-curve PNG, val-curve comparison), `progress` (live progress line). A run:
`train_options` (the flags) -> `train_plan` (checked once, with the engine config of
`train_config`) -> `trainer` (ranks, data, engine on one rank) -> `train` (the loop).
The `z train` and `z export-mixtral` commands (`zstack.cmd_train`, `zstack.cmd_export`)
parse flags into these and print.
"""

__version__ = "0.1.0"
