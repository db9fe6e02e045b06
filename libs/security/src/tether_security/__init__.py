"""Safety building blocks: secrets, redaction, untrusted-content envelopes, and the tool sandbox."""
