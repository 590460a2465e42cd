"""Offline training of the bundled tiny target and its drafters: corpus, tokenizer, target.

CLI tools: may import anything below `serve/`; nothing in the package imports `train/`.
"""
