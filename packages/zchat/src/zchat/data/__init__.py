"""zchat's datasets: real or program-checked tasks, rendered with the model's chat template.

::

    from zchat.data import build_chat_data, load_tokenizer, answer_batch
    data = build_chat_data("arithmetic", train=512, heldout=128, seed=0)
    tok = load_tokenizer(model_dir)            # refuses a model without a chat template
    batch = answer_batch(tok, [(e.messages, e.answer) for e in data.sft_train[:8]])
    # batch["labels"] is -100 except on the answer tokens

Tasks (``TASKS``) and their preference rules (``ChatData.rule``):

- ``arithmetic``: "What is a + b?"; the correct sum is preferred over ``a+b+d``, ``d`` in
  ±1..±9 (:func:`check_sum` grades any answer).
- ``shakespeare``: continue two spoken lines of a play; the real next line is preferred
  over a line drawn from another play (plays from ztrain's ``load_plays``).
"""

from zchat.data.arithmetic import check_sum, operands_of
from zchat.data.build import TASKS, build_chat_data
from zchat.data.render import (
    IGNORE,
    ChatTemplateError,
    answer_batch,
    check_chat_template,
    load_tokenizer,
    pad_right,
    pair_batch,
    render_answer,
    render_prompt,
    tokenizer_fingerprint,
)
from zchat.data.types import (
    ChatData,
    EmptyDatasetError,
    PreferencePair,
    Prompt,
    SFTExample,
    require_nonempty,
)

__all__ = [
    "IGNORE",
    "TASKS",
    "ChatData",
    "ChatTemplateError",
    "EmptyDatasetError",
    "PreferencePair",
    "Prompt",
    "SFTExample",
    "answer_batch",
    "build_chat_data",
    "check_chat_template",
    "check_sum",
    "load_tokenizer",
    "operands_of",
    "pad_right",
    "pair_batch",
    "render_answer",
    "render_prompt",
    "require_nonempty",
    "tokenizer_fingerprint",
]
