"""lioncub-invite: an invited run's authority: make it, issue tickets, revoke them.

    lioncub-invite authority --key authority.key             # once, by the organizer: prints the authority id
    lioncub-invite id --identity-path me.key                 # each volunteer: prints the peer id to send
    lioncub-invite issue --key authority.key --run-id demo --peer PEER_ID --days 30 --max-weight 100 > t.txt
    lioncub-invite show t.txt                                # what a ticket says
    lioncub-invite revoke --serial SERIAL --list revoked.txt  # lioncub-coordinator --revoked revoked.txt publishes it

A ticket binds one peer id to the run, with an expiry and the most reduction weight it may claim;
the volunteer trains with ``lioncub-train --ticket t.txt --identity-path me.key``. Keep the
authority key offline or on the coordinator: whoever holds it can admit identities.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..identity import Identity, Verifier
from ..swarm.tickets import MAX_DAYS, TicketError, decode, issue, read_serials_file
from .checks import check_run_id
from .common import HelpFormatter, UsageError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lioncub-invite", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("authority", help="create the run's authority key (if missing) and print its id")
    a.add_argument("--key", required=True, help="the authority's private key file")
    i = sub.add_parser("id", help="create a peer identity (if missing) and print its peer id")
    i.add_argument("--identity-path", required=True, help="the key file lioncub-train --identity-path will use")
    s = sub.add_parser("issue", help="sign a ticket for one peer id (written to stdout, or --out)")
    s.add_argument("--key", required=True, help="the authority's private key file")
    s.add_argument("--run-id", required=True, help="the run the ticket admits to")
    s.add_argument("--peer", required=True, help="the volunteer's peer id (lioncub-invite id prints it)")
    s.add_argument("--days", type=float, default=30.0, help="how long the ticket is valid")
    s.add_argument("--max-weight", type=float, default=100.0,
                   help="the most reduction weight the holder may claim (its --weight is capped at this)")
    s.add_argument("--out", default=None, help="write the ticket to this file instead of stdout")
    w = sub.add_parser("show", help="print what a ticket says and whether its signature holds")
    w.add_argument("ticket", help="the ticket file")
    r = sub.add_parser("revoke", help="add a ticket's serial to a revocation list file")
    r.add_argument("--serial", required=True, help="the ticket's serial (lioncub-invite show prints it)")
    r.add_argument("--list", required=True, help="the list lioncub-coordinator --revoked publishes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        print(run(args))
    except (UsageError, TicketError) as e:
        raise SystemExit(f"error: {e}")


def _identity(path: str, flag: str, *, create: bool) -> Identity:
    if not create and not Path(path).exists():
        raise UsageError(f"{flag} {path} does not exist: create it with lioncub-invite authority --key {path}")
    try:
        return Identity.load_or_create(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag} {path}: not a usable key file ({e})") from None


def read_ticket(path: str) -> str:
    """A ticket's text from a file (UsageError, one line, if it cannot be read)."""
    try:
        return Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot read the ticket ({getattr(e, 'strerror', None) or e})") from None


def run(args: argparse.Namespace) -> str:
    """What the command prints."""
    if args.command == "authority":
        return _identity(args.key, "--key", create=True).peer_id
    if args.command == "id":
        return _identity(args.identity_path, "--identity-path", create=True).peer_id
    if args.command == "issue":
        check_run_id(args.run_id)
        if not 0 < args.days <= MAX_DAYS:
            raise UsageError(f"--days must be in (0, {MAX_DAYS:g}], got {args.days:g}")
        ticket = issue(_identity(args.key, "--key", create=False), args.run_id, args.peer, days=args.days,
                       max_weight=args.max_weight)
        if args.out:
            Path(args.out).write_text(ticket.text() + "\n")
            print(ticket.describe(), file=sys.stderr)
            return f"wrote {args.out}"
        print(ticket.describe(), file=sys.stderr)
        return ticket.text()
    if args.command == "show":
        return decode(read_ticket(args.ticket), Verifier()).describe()
    if args.command == "revoke":
        listed = read_serials_file(args.list) if Path(args.list).exists() else []
        serial = decode_serial(args.serial)
        if serial in listed:
            return f"{serial} is already in {args.list}"
        with open(args.list, "a") as f:
            f.write(serial + "\n")
        return f"revoked {args.serial} in {args.list}: coordinators started with --revoked {args.list} publish it " \
               f"within a minute, and members refuse its holder from then on"
    raise UsageError(f"unknown command {args.command}")


def decode_serial(serial: str) -> str:
    serial = serial.strip().lower()
    if len(serial) != 16 or any(c not in "0123456789abcdef" for c in serial):
        raise UsageError(f"--serial {serial!r} is not a ticket serial (16 hex digits: lioncub-invite show prints it)")
    return serial


if __name__ == "__main__":
    main()
