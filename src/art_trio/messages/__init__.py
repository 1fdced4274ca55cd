"""Layer 1, messages: plain values and errors that every layer may use; imports no other layer."""
