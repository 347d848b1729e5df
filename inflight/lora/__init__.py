"""Multi-LoRA: adapters and their configuration (issue 33).

``lora_config``: ``LoRAConfig`` and vLLM's flags (``--enable-lora``, ``--lora-modules``,
``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``), torch-free. ``adapter``: a
Hugging Face PEFT directory read, validated and fused into the model's layout
(``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``). ``registry``: the adapters a
server knows by name, a stable id each, at most ``max_cpu_loras`` held in memory.

The part imports nothing else of ``inflight`` (the model's shapes come in through the
``adapter.ModelShape`` protocol, which ``model.hparams.ModelConfig`` satisfies), so the
model, runner, engine and config may all import it. Import from the modules: this file
stays empty so that ``lora_config`` loads without torch.
"""
