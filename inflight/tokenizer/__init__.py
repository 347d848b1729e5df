"""Tokenization for inflight: GGUF/HF tokenizer loading, chat templates, streaming detokenization.

``Tokenizer`` wraps a Hugging Face ``tokenizers`` backend; ``render_chat_template`` renders Jinja
chat templates in a bounded sandbox like transformers (``ConversationRejectedError``: the
client's fault; ``ChatTemplateError``: the model template's fault; see
:mod:`inflight.tokenizer.chat`); ``check_chat_template`` refuses an unsafe template at start-up;
``IncrementalDetokenizer`` turns a request's output ids into streamed text deltas with
stop-string handling.
"""

from inflight.tokenizer.chat import (ChatTemplateError, ConversationRejectedError,
                                     UnsafeChatTemplateError, check_chat_template,
                                     render_chat_template)
from inflight.tokenizer.detokenizer import IncrementalDetokenizer
from inflight.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplateError", "ConversationRejectedError", "IncrementalDetokenizer",
           "Tokenizer", "UnsafeChatTemplateError", "check_chat_template", "render_chat_template"]
