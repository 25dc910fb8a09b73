"""A SentencePiece model as a Hugging Face tokenizer, and back.

:func:`to_hf_tokenizer` builds a ``tokenizers``-backed tokenizer that follows the model's own
normalizer spec (its precompiled NFKC map, whitespace handling and dummy prefix), byte fallback
and BPE merges ranked by piece score, so that ``AutoTokenizer`` encodes text to the ids
``tools/preprocess_data.py`` wrote. Two things differ from a plain conversion, both to match
SentencePiece: the special pieces' strings inside a text (``"</s>"`` in a docstring) are encoded
as text, never as the special id (``split_special_tokens``); and every text gets the dummy prefix,
also when it starts with spaces that the normalizer removes. Measured on 2,009 documents of the
stdlib corpus (docs/checkpoints.md): the same ids for all but one, where ``tokenizers``' NFKC map
left a composed Tamil vowel sign decomposed.

The SentencePiece file itself travels too (``tokenizer.model``, as in Llama's folders), so that
``from-hf`` hands it back to ``--tokenizer-model``.
"""

import os
import shutil

import sentencepiece as spm

from megatron_dilocox.errors import ConfigError

SENTENCEPIECE_FILE = "tokenizer.model"  # the name Llama's Hugging Face folders give it


def special_ids(sp: spm.SentencePieceProcessor) -> dict[str, int]:
    """The special ids a SentencePiece model has, by kind: ``bos``, ``eos``, ``pad``, ``unk``."""
    ids = {"bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id(), "unk": sp.unk_id()}
    return {kind: i for kind, i in ids.items() if i >= 0}


def to_hf_tokenizer(model_path: str):
    """The SentencePiece model at ``model_path`` as a ``PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    sp = spm.SentencePieceProcessor(model_file=model_path)
    proto = import_protobuf().ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    # legacy=True: the dummy prefix on every text, as SentencePiece adds it (with "first", a text
    # whose leading spaces the normalizer strips gets none).
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    if backend is None:
        raise ConfigError(f"{model_path}: a SentencePiece {proto.trainer_spec.model_type} model does not convert")
    names = {f"{kind}_token": sp.id_to_piece(i) for kind, i in special_ids(sp).items()}
    return PreTrainedTokenizerFast(tokenizer_object=backend, split_special_tokens=True, **names)


def save_hf_tokenizer(model_path: str, folder: str) -> None:
    """Writes the tokenizer of :func:`to_hf_tokenizer` and the SentencePiece file into ``folder``."""
    to_hf_tokenizer(model_path).save_pretrained(folder)
    shutil.copyfile(model_path, os.path.join(folder, SENTENCEPIECE_FILE))
