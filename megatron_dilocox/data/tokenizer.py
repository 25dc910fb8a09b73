"""Tokenizers usable as ``GPTDatasetConfig.tokenizer`` in megatron-core 0.16.1.

megatron-core's datasets read ``vocab_size`` (token dtype), ``eod`` (document
boundaries for position-id/attention-mask resets), ``pad`` and ``eos`` (loss
masking; pad must differ from eod/eos) and ``unique_identifiers`` (part of the
hash naming the cached sample indices). The tools additionally use ``tokenize``
and ``detokenize``, and ``identity``, which ``tools/preprocess_data.py`` records next to a
dataset (``PREFIX`` + :data:`IDENTITY_SUFFIX`) so that training refuses another tokenizer.
"""

import hashlib
import os
from collections import OrderedDict
from typing import Dict, List, Optional, Union

import sentencepiece as spm
from megatron.core.tokenizers import MegatronTokenizerBase

TOKENIZER_TYPES = ("SentencePieceTokenizer", "NullTokenizer")
IDENTITY_SUFFIX = ".tokenizer.json"


class SentencePieceTokenizer(MegatronTokenizerBase):
    """Wraps a SentencePiece model; end-of-document (``eod``) is the model's eos id.

    Args:
        model_path: Path to a ``.model`` file, e.g. from ``tools/train_tokenizer.py``.

    Raises:
        ValueError: If the file is missing, not a SentencePiece model, or has no eos id.
    """

    def __init__(self, model_path: str) -> None:
        if not os.path.isfile(model_path):
            raise ValueError(f"tokenizer model not found: {model_path}")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_path)
        except (OSError, RuntimeError):
            raise ValueError(f"not a valid sentencepiece model: {model_path}") from None
        if self._sp.eos_id() < 0:
            raise ValueError(f"sentencepiece model has no eos (end-of-document) id: {model_path}")
        super().__init__(model_path, {})
        with open(model_path, "rb") as f:
            self._digest = hashlib.sha256(f.read()).hexdigest()

    @property
    def unique_identifiers(self) -> "OrderedDict[str, str]":
        """Identity for megatron-core's dataset cache hashes: class, path and model digest."""
        return OrderedDict(
            [
                ("class", type(self).__name__),
                ("tokenizer_path", os.path.abspath(self.path)),
                ("model_sha256", self._digest),
            ]
        )

    @property
    def identity(self) -> Dict[str, Union[str, int, None]]:
        """Type, model file (absolute path) and its sha256, vocabulary size."""
        return {"tokenizer_type": type(self).__name__, "model": os.path.abspath(self.path),
                "model_sha256": self._digest, "vocab_size": self.vocab_size}

    @property
    def vocab_size(self) -> int:
        """Number of pieces in the model."""
        return self._sp.get_piece_size()

    @property
    def vocab(self) -> Dict[str, int]:
        """Mapping from piece to id."""
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def eod(self) -> int:
        """End-of-document id (the eos id)."""
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        """End-of-sequence id."""
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        """Beginning-of-sequence id (-1 if undefined)."""
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        """Padding id (-1 if undefined)."""
        return self._sp.pad_id()

    @property
    def unk(self) -> int:
        """Unknown-piece id."""
        return self._sp.unk_id()

    def tokenize(self, text: str) -> List[int]:
        """Encodes text to ids (no bos/eos added)."""
        return self._sp.encode(text)

    def detokenize(self, ids: List[int]) -> str:
        """Decodes ids to text."""
        return self._sp.decode([int(i) for i in ids])

    def apply_chat_template(self, *args, **kwargs):
        """Not supported: pretraining tokenizers have no chat template."""
        raise NotImplementedError(f"{type(self).__name__} has no chat template")


class NullTokenizer(MegatronTokenizerBase):
    """Megatron-LM's null tokenizer for mock data: text is whitespace-separated ids.

    The eod id is ``vocab_size`` (one past the given ids), so ``self.vocab_size`` is
    ``vocab_size + 1``. There is no pad token (``pad`` is -1).

    Args:
        vocab_size: Number of ordinary ids, 0..vocab_size-1.
    """

    def __init__(self, vocab_size: int) -> None:
        if int(vocab_size) < 1:
            raise ValueError(f"NullTokenizer needs a positive vocab size, got {vocab_size}")
        super().__init__(None, {})
        self._eod = int(vocab_size)

    @property
    def unique_identifiers(self) -> "OrderedDict[str, str]":
        """Identity of this tokenizer for megatron-core's dataset cache hashes."""
        return OrderedDict([("class", type(self).__name__), ("vocab_size", str(self.vocab_size))])

    @property
    def identity(self) -> Dict[str, Union[str, int, None]]:
        """Type and vocabulary size (there is no model file)."""
        return {"tokenizer_type": type(self).__name__, "model": None, "model_sha256": None,
                "vocab_size": self.vocab_size}

    @property
    def vocab_size(self) -> int:
        """Number of ordinary ids plus one for eod."""
        return self._eod + 1

    @property
    def vocab(self) -> Dict[str, int]:
        """Mapping from the decimal string of each id to the id."""
        return {str(i): i for i in range(self.vocab_size)}

    @property
    def eod(self) -> int:
        """End-of-document id."""
        return self._eod

    @property
    def eos(self) -> int:
        """End-of-sequence id (same as eod)."""
        return self._eod

    @property
    def pad(self) -> int:
        """No pad token: -1."""
        return -1

    def tokenize(self, text: str) -> List[int]:
        """Parses whitespace-separated integers."""
        return [int(tok) for tok in text.split()]

    def detokenize(self, ids: List[int]) -> str:
        """Joins ids with single spaces."""
        return " ".join(str(int(i)) for i in ids)

    def apply_chat_template(self, *args, **kwargs):
        """Not supported."""
        raise NotImplementedError(f"{type(self).__name__} has no chat template")


def build_tokenizer(
    tokenizer_type: str, tokenizer_model: Optional[str], vocab_size_for_null: Optional[int] = None
) -> MegatronTokenizerBase:
    """Builds a tokenizer from Megatron-style ``--tokenizer-*`` settings.

    Args:
        tokenizer_type: ``"SentencePieceTokenizer"`` or ``"NullTokenizer"``.
        tokenizer_model: Path to the SentencePiece model (SentencePieceTokenizer only).
        vocab_size_for_null: Vocab size without eod (NullTokenizer only).

    Returns:
        The tokenizer.

    Raises:
        ValueError: On an unknown type or missing/invalid settings, with a one-line message.
    """
    if tokenizer_type == "SentencePieceTokenizer":
        if not tokenizer_model:
            raise ValueError("--tokenizer-model is required for SentencePieceTokenizer")
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        if vocab_size_for_null is None:
            raise ValueError("--vocab-size is required for NullTokenizer")
        return NullTokenizer(vocab_size_for_null)
    raise ValueError(
        f"--tokenizer-type: unknown tokenizer {tokenizer_type!r}; "
        f"choose from {', '.join(TOKENIZER_TYPES)}"
    )
