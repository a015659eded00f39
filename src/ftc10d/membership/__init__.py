"""Membership: failure detection, agreement on the next configuration, fencing.

Knows nothing of training, and uses the ProcessGroup only through its public
API (``get_reconfigure_handle``, ``ftc10d.reconfigure``, ``add_error_listener``,
``register_pre_hook``, ``generation.handles``).

Typical use, one ``Member`` per rank::

    from ftc10d.membership import Member, TCPMembershipStore

    store = TCPMembershipStore(host, port)            # or EtcdMembershipStore([...endpoints])
    member = Member(store, pg.get_reconfigure_handle(), min_members=2, expected=world_size).join()
    member.attach(pg)                                 # peer failures -> detection; fenced ops raise Fenced
    member.sync(pg)                                   # wait for admission, reconfigure pg onto it
    while training:
        try:
            step()
        except ftc10d.CollectiveError:
            member.sync(pg)                           # the next configuration (fresh uuid, survivors)

Under ``ftc10d launch`` the launcher is its node's member (:class:`NodeAgent`): its
ranks are still listed in every configuration, but they beat to it and receive
configurations from it over a local socket, so the store's load grows with the
node count, not the rank count (``Member(..., node_agent=path)``).

A supervisor that sees a worker exit calls ``report_exit(handle)`` (on a
``Member``, or on ``Agreement``/``Coordinator.agreement()`` if it is not one).
"""

from ftc10d.membership.agent import NodeAgent
from ftc10d.membership.agreement import Agreement, Configuration, MemberInfo, Outcome, Status
from ftc10d.membership.member import Member
from ftc10d.membership.records import TOKEN_ENV, Signer
from ftc10d.membership.store import MembershipStore
from ftc10d.membership.tcp import Coordinator, ReconnectingTCPStore, TCPMembershipStore

__all__ = [
    "Member",
    "NodeAgent",
    "Configuration",
    "Status",
    "Outcome",
    "MemberInfo",
    "Agreement",
    "MembershipStore",
    "TCPMembershipStore",
    "EtcdMembershipStore",
    "Coordinator",
    "ReconnectingTCPStore",
    "Signer",
    "TOKEN_ENV",
]


def __getattr__(name: str) -> object:
    # The etcd backend needs etcd3gw/requests (the ``etcd`` extra): import it only when asked for.
    if name == "EtcdMembershipStore":
        from ftc10d.membership.etcd import EtcdMembershipStore

        return EtcdMembershipStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
