"""The Megatron-core learner (`megatron_train`): plan and args, model build, batches, ranks as
Ray actors, and the Hugging Face <-> Megatron parameter-name mapping (`name_mapping.py`)."""
