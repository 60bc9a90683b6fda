"""A character-level tokenizer built in code, for the models SpotRL builds itself.

One token per character of the arithmetic alphabet (digits, ``+``, ``-``, ``=``, space) plus
``<pad>``, ``<bos>``, ``<eos>`` and ``<unk>``. Encoding prepends ``<bos>``; decoding joins the
characters back with nothing between them. Saved with ``save_pretrained`` it is an ordinary
Hugging Face tokenizer folder that ``AutoTokenizer`` (and vLLM) load without our code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
ARITHMETIC_ALPHABET = "0123456789+-= "


def char_vocabulary(alphabet: str = ARITHMETIC_ALPHABET, pad_to: int = 0) -> dict[str, int]:
    """Token → id: the special tokens first (pad 0, bos 1, eos 2, unk 3), then one id per character.

    ``pad_to`` adds unused ``<extra_N>`` tokens until the vocabulary has that many entries, so a
    bigger model built for timing can share this tokenizer and still decode every id it samples.
    """
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet {alphabet!r} repeats a character")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    while len(vocab) < pad_to:
        vocab[f"<extra_{len(vocab)}>"] = len(vocab)
    return vocab


def build_char_tokenizer(alphabet: str = ARITHMETIC_ALPHABET, pad_to: int = 0) -> PreTrainedTokenizerBase:
    """Builds the character tokenizer as a transformers fast tokenizer (nothing is downloaded)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocabulary(alphabet, pad_to)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token; WordLevel then maps it to its id.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
