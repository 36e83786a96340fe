"""Parameter names as the model defines them, whatever wraps its modules."""

# Wrappers (activation checkpointing, torch.compile) insert these into parameter names.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_fqn(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
