"""AdaFlash: keeps speculative-decoding drafters fresh on live LLM traffic."""

__version__ = "0.1.0"
