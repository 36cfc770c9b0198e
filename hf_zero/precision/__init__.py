"""Numeric precision: the dtypes a config asks for and how a step stays finite in them.

``policies.py`` holds the bf16/fp16/fp32 policies and the fp16 dynamic loss scaler (DeepSpeed's rules);
``float8.py`` puts the user's linears in float8 through torchao (it sits a layer higher: it places modules).
"""
