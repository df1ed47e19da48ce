def sglang_argv(python, model_dir, port, *, served_model_name="tiny", max_lora_rank=16,
                lora_target_modules=("all",), max_loaded_loras=None, max_loras_per_batch=None,
                max_total_tokens=4096, api_key=None, host="127.0.0.1"):
    """argv for a real SGLang 0.5.23 CPU server with runtime LoRA (docs/engines/sglang.md)."""
    argv = [
        str(python), "-m", "sglang.launch_server",
        "--model-path", str(model_dir), "--served-model-name", served_model_name,
        "--device", "cpu", "--dtype", "float32",
        "--enable-lora", "--max-lora-rank", str(max_lora_rank),
        "--lora-target-modules", *lora_target_modules,
        "--lora-backend", "torch_native",
        "--max-total-tokens", str(max_total_tokens),
        "--disable-overlap-schedule", "--skip-server-warmup",
        "--host", host, "--port", str(port),
    ]
    if max_loaded_loras is not None:
        argv += ["--max-loaded-loras", str(max_loaded_loras)]
    if max_loras_per_batch is not None:
        argv += ["--max-loras-per-batch", str(max_loras_per_batch)]
    if api_key is not None:
        argv += ["--api-key", api_key]
    return argv

SGLANG_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
# ready: GET /ready == 200   stop: SIGTERM to the launch pid
