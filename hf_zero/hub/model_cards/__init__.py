"""Model cards: what a saved folder records about its training, and the ``README.md`` built from it.

A card is often written long after training (``hf-zero push`` of a folder, on another machine),
when only the folder is left. So every save records what the card needs in the folder itself
(:mod:`hf_zero.hub.model_cards.record`: the resolved ZeRO config, world size and devices, framework
versions, base model, and for Trainer runs the hyperparameters and evaluation results), and
:mod:`hf_zero.hub.model_cards.card` renders ``README.md`` from that record and the folder's files with
``huggingface_hub.ModelCard`` / ``ModelCardData``, so the metadata is what the Hub indexes.
"""
