"""The embedded datasets the recipes train on offline, generated deterministically, each with what scores it:
support tickets (classification), tagged ticket sentences (tagging), support conversations and preference pairs
made from them (chat, DPO), whose replies name the team that owns the ticket.

Imports nothing of the package outside this folder.
"""
