from tests.e2e.conftest import chat_prompts, hf_reference  # noqa: F401  (shared fixtures)
