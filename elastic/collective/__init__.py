"""Collective communication for one generation of ranks; no Ray here."""

from elastic.collective.communicator import Communicator
from elastic.collective.rendezvous import Endpoint, RendezvousServer

__all__ = ["Communicator", "Endpoint", "RendezvousServer"]
