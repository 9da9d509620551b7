"""Few-line adapters for the trainers users already run: Hugging Face Trainer, Lightning and
Megatron-core (`vigil.integrations.<framework>`).

Each adapter drives the public SDK (`vigil.agent`) and nothing else of vigil, and imports its
framework only when the adapter module itself is imported: every framework is an optional extra
(`pip install 'vigil[hf]'`, `'vigil[lightning]'`, `'vigil[megatron]'`), never a dependency of
vigil. No other vigil subsystem imports this package (import-linter contracts).
"""
