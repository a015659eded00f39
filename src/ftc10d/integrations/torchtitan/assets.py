"""A tokenizer and a text dataset for torchtitan's small models, made here, nothing downloaded.

torchtitan's debug configs read a tokenizer (``--hf-assets-path``: ``tokenizer.json`` and
``tokenizer_config.json``) and the ``c4_test`` dataset (``--dataloader.dataset-path``: a
folder of JSON-lines files with a ``text`` field), neither of which is in its wheel. For
``make demo-titan`` and the tests, :func:`build` writes both from a seeded grammar: a
byte-level BPE of at most 2000 tokens (the debug model's vocabulary is 2048) trained with
``tokenizers``, and 1000 documents (~276k tokens). Same bytes on every run.
"""

from __future__ import annotations

import json
import os
import random

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
_SUBJECTS = ["the cat", "a dog", "the model", "my friend", "the teacher", "a small bird", "the old man", "our team",
             "the river", "a red fox", "the engineer", "the child"]
_VERBS = ["sees", "likes", "finds", "builds", "carries", "follows", "watches", "paints", "moves", "trains", "feeds",
          "opens"]
_OBJECTS = ["the ball", "a book", "the door", "a tree", "the bridge", "some bread", "the garden", "a letter",
            "the machine", "a window", "the boat", "the map"]
_PLACES = ["in the park", "near the sea", "at home", "under the table", "on the hill", "by the station",
           "in the morning", "after lunch", "before dark", "at school"]
_LINKS = ["and then", "because", "while", "so", "but later"]


def _sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}"
    if rng.random() < 0.4:
        s += f" {rng.choice(_LINKS)} {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.3:
        s += f", number {rng.randint(0, 999)}"
    return s[0].upper() + s[1:] + "."


def documents(n: int = 1000, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(5, 40))) for _ in range(n)]


def build(out: str, vocab: int = 2000) -> tuple[str, str]:
    """Write ``out/tokenizer`` and ``out/c4_local`` (module docstring); returns their paths
    (for ``--hf-assets-path`` and ``--dataloader.dataset-path``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok_dir, data_dir = os.path.join(out, "tokenizer"), os.path.join(out, "c4_local")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    docs = documents()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainer=trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False,
                   "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2,
                  sort_keys=True)
    with open(os.path.join(data_dir, "data.json"), "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return tok_dir, data_dir
