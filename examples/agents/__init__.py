"""Example agent programs (docs/agentic.md): each uses only the ``openai`` client."""
