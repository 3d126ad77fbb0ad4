"""Emulated targets and network emulation: in-process targets, a delaying TCP relay, netns."""
