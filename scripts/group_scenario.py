"""Consumer groups against the broker example, driven by kafka-python (a
client nobody on this project wrote).

Usage: group_scenario.py HOST:PORT

Two consumers in one group split four partitions; one leaves and the other
takes all four; a third is killed (SIGKILL, no leave) and the survivor takes
all four once its session expires; every record is read once per group;
commits survive a consumer restart. Prints one JSON line of timings and exits
0, or exits 1 with the reason.
"""

import json
import os
import subprocess
import sys
import time

from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition

SERVER = sys.argv[1]
TOPIC = "groups"
GROUP = "scenario"
SESSION_MS = 6000


def fail(why):
    print(f"FAIL: {why}", file=sys.stderr)
    sys.exit(1)


def consumer(name):
    return KafkaConsumer(
        TOPIC,
        bootstrap_servers=SERVER,
        group_id=GROUP,
        client_id=name,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=SESSION_MS,
        heartbeat_interval_ms=300,
        max_poll_interval_ms=60000,
        fetch_max_wait_ms=100,
    )


def poll_until(consumers, cond, what, limit=20.0, seen=None):
    """Polls every consumer until cond(); records what each read in seen."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            assigned = [sorted(p.partition for p in c.assignment()) for c in consumers]
            states = [
                (c._coordinator.state, c._coordinator._generation) for c in consumers
            ]
            fail(f"timed out waiting for {what}; assignments {assigned}, states {states}")
        for c in consumers:
            for tp, records in c.poll(timeout_ms=100).items():
                for r in records:
                    if seen is not None:
                        seen.append((tp.partition, r.offset, r.value))


def parts(c):
    return sorted(p.partition for p in c.assignment())


def main():
    if len(sys.argv) > 2 and sys.argv[2] == "--victim":
        # The consumer that gets killed: joins, then waits to be killed.
        c = consumer("victim")
        poll_until([c], lambda: len(c.assignment()) > 0, "the victim's assignment")
        print("joined", flush=True)
        while True:
            c.poll(timeout_ms=100)

    timings = {}
    producer = KafkaProducer(bootstrap_servers=SERVER, acks=1)
    for i in range(40):
        producer.send(TOPIC, value=b"r%d" % i, partition=i % 4)
    producer.flush()

    seen = []
    t = time.monotonic()
    c1 = consumer("c1")
    poll_until([c1], lambda: parts(c1) == [0, 1, 2, 3], "c1 alone to hold all four", seen=seen)
    timings["first_join_s"] = round(time.monotonic() - t, 3)

    t = time.monotonic()
    c2 = consumer("c2")
    poll_until(
        [c1, c2],
        lambda: len(parts(c1)) == 2 and len(parts(c2)) == 2,
        "c1 and c2 to split the four partitions",
        seen=seen,
    )
    timings["rebalance_on_join_s"] = round(time.monotonic() - t, 3)
    if sorted(parts(c1) + parts(c2)) != [0, 1, 2, 3]:
        fail(f"split {parts(c1)} / {parts(c2)}")

    # Read all forty, then commit what each holds.
    poll_until([c1, c2], lambda: len({(p, o) for p, o, _ in seen}) >= 40, "all 40 records", seen=seen)
    c1.commit()
    c2.commit()

    t = time.monotonic()
    c2.close()  # a LeaveGroup
    poll_until([c1], lambda: parts(c1) == [0, 1, 2, 3], "c1 to take all four after c2 left", seen=seen)
    timings["rebalance_on_leave_s"] = round(time.monotonic() - t, 3)

    victim = subprocess.Popen(
        [sys.executable, __file__, SERVER, "--victim"], stdout=subprocess.PIPE, text=True
    )
    poll_until([c1], lambda: len(parts(c1)) < 4, "the victim to take a share", seen=seen)
    line = victim.stdout.readline()
    if line.strip() != "joined":
        fail(f"the victim said {line!r}")
    t = time.monotonic()
    victim.kill()
    victim.wait()
    poll_until(
        [c1],
        lambda: parts(c1) == [0, 1, 2, 3],
        "c1 to take all four after the victim was killed",
        limit=SESSION_MS / 1000 + 10,
        seen=seen,
    )
    timings["rebalance_after_kill_s"] = round(time.monotonic() - t, 3)

    # Every record read by the group (the victim may have read some of its
    # share; nothing was committed for those, so c1 reads them again).
    offsets = {(p, o) for p, o, _ in seen}
    if offsets != {(p, o) for p in range(4) for o in range(10)}:
        fail(f"read {len(offsets)} distinct records, not the 40 produced")
    c1.commit()
    c1.close()

    # A restarted consumer starts from the commits: only what is new.
    for i in range(4):
        producer.send(TOPIC, value=b"new%d" % i, partition=i)
    producer.flush()
    again = []
    c3 = consumer("c3")
    poll_until([c3], lambda: len(again) >= 4, "the four new records after a restart", seen=again)
    time.sleep(0.3)
    for tp, records in c3.poll(timeout_ms=300).items():
        again.extend((tp.partition, r.offset, r.value) for r in records)
    if sorted(v for _, _, v in again) != [b"new0", b"new1", b"new2", b"new3"]:
        fail(f"after a restart read {again}")
    committed = {p: c3.committed(TopicPartition(TOPIC, p)) for p in range(4)}
    c3.commit()
    c3.close()
    producer.close()
    timings["committed_before_restart"] = committed
    print(json.dumps(timings))


if __name__ == "__main__":
    main()
