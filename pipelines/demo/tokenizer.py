"""A byte-level BPE tokenizer trained on the synthetic corpus.

Byte-level, so nothing is ever unknown. Digits are split one per token: the model copies and rewrites
codes digit by digit. The space before a word belongs to the word (" Billing") and a space before a
digit is a token of its own, so `tokenize(prompt + " " + answer)` always starts with `tokenize(prompt)`
when the prompt ends without a trailing space: lm-eval's log-likelihood scoring relies on that.
No BOS is added: the server, lm-eval and the training loop all see exactly the prompt's tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<s>", "</s>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
