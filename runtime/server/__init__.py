"""OpenAI-compatible HTTP server over the LLMEngine (`k3compile serve`)."""
