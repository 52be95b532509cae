"""Hashed n-gram tables (DeepSeek Engram, Qwen PLE): geometry, checkpoint reading, staging."""
