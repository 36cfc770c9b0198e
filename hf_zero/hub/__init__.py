"""The Hugging Face Hub: pushing a trained folder and pulling one back (``transfer.py``) and the model card
written with it (``model_cards/``: the card and the engine's record that feeds it).
"""
