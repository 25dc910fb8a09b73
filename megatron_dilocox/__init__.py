"""megatron-dilocox: Megatron-core GPT pretraining with DiLoCoX outer sync across clusters."""
