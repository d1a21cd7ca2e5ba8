"""Speculative decoding: guess a request's next tokens cheaply, and let one step check them all."""
