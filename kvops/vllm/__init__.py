"""vLLM as a kvops engine: installing its CPU build in its own virtual environment, exporting the shipped
model to a directory vLLM can load, and the command line that starts it.

vLLM pins its own transformers and pulls GPU builds of torchvision / torchaudio / torchcodec, which clash
with kvops's environment, so it lives in a venv of its own and kvops talks to it only as a subprocess and
over HTTP. See docs/vllm.md.
"""
