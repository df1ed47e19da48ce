"""lorafleet: verified, versioned, atomic LoRA adapter publication to inference fleets."""

__version__ = "0.1.0"
