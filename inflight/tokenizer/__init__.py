"""Tokenization for inflight: GGUF/HF tokenizer loading, chat templates, streaming detokenization.

``Tokenizer`` wraps a Hugging Face ``tokenizers`` backend; ``render_chat_template`` renders Jinja
chat templates in a sandbox like transformers; ``IncrementalDetokenizer`` turns a request's output
ids into streamed text deltas with stop-string handling.
"""

from inflight.tokenizer.chat import render_chat_template
from inflight.tokenizer.detokenizer import IncrementalDetokenizer
from inflight.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "render_chat_template"]
