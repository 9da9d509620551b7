"""The bundled parallel GPT-style trainer that uses the SDK and recovers under the controller.

vigil.trainer: its public API is re-exported here as it lands.
"""

__all__: list[str] = []
