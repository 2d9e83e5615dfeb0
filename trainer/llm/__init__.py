"""The LLM path: a model gateway that serves checkpoints behind an OpenAI-compatible API and
records every attributed call's token ids as a span, and the pieces `grpo_lm` trains with.

- tokenizer.py: tokenizers built with `tokenizers` (the examples ship no files) and chat prompts;
- engine.py: one loaded checkpoint (Hugging Face model classes) decoding a batch of requests;
- decoding.py: a batch decoded step by step, which sequences join and leave between steps;
- batcher.py: continuous batching of concurrent requests onto engines, projects in turn;
- registry.py: which checkpoint versions are loaded (hot reload, at most N at once);
- calls.py: an LLM call as a span of its attempt (AGL 0.3's attribute names);
- openai_api.py: the OpenAI request/response shapes; gateway.py: the Starlette app;
- upstream.py: forwarding to another OpenAI-compatible server (vLLM, SGLang);
- server.py: running the app under uvicorn (its own process, or a thread of the embedded default).

Everything heavy (torch, transformers) loads on first use.
"""
