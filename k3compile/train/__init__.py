"""Training the small target and its DSpark drafter (issue 13): corpus, loops, losses, curves, acceptance."""
