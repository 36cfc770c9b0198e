# The package marker of https://github.com/karpathy/minGPT (mingpt/__init__.py, empty there), so that
# model.py's own "from mingpt.utils import CfgNode" resolves.
