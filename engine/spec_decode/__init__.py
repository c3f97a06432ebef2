"""Speculative decoding: a proposer guesses a sequence's next k tokens, the target model scores all of them
in one forward, and the rejection rule keeps the longest prefix the target's own sampling agrees with
(plus one token of the target's), so the output distribution is exactly the target's.

ngram.py: the prompt-lookup proposer; rejection.py: the acceptance rule; speculator.py: which steps speculate
(measured step times) and which sequences how far (the cost model), and their acceptance statistics.
"""

from engine.spec_decode.rejection import accepted_lengths, expand_rows, verify_row
from engine.spec_decode.speculator import Speculator

__all__ = ["Speculator", "accepted_lengths", "expand_rows", "verify_row"]
