"""The manager host-provider protocol (docs/host-provider.md): how coldsnap reaches a unit's host through the
manager's own transport, every credential left with the manager.

- :mod:`coldsnap.provider.messages`: the protocol, format 1: its messages, framing and failure codes;
- :mod:`coldsnap.provider.client`: coldsnap's side, one connection per operation (:class:`~coldsnap.provider.client.HostProvider`);
- :mod:`coldsnap.provider.server` and :mod:`coldsnap.provider.hosts`: the reference provider,
  ``coldsnap provider serve``, for users with no manager of their own (hosts reached by ``local``, ``nsenter``
  or ``ssh``).
"""
