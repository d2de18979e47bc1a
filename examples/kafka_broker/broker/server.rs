//! Connections: Kafka's framing (a 4-byte size, then a request header and
//! body), one request at a time per connection in order as Kafka's broker
//! does, and the answers that need no waiting (`ApiVersions`, `Metadata`,
//! `ListOffsets`).

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use kafka_protocol::error::ResponseError;
use kafka_protocol::messages::api_versions_response::ApiVersion;
use kafka_protocol::messages::list_offsets_request::ListOffsetsPartition;
use kafka_protocol::messages::list_offsets_response::{
    ListOffsetsPartitionResponse, ListOffsetsTopicResponse,
};
use kafka_protocol::messages::metadata_response::{
    MetadataResponseBroker, MetadataResponsePartition, MetadataResponseTopic,
};
use kafka_protocol::messages::*;
use kafka_protocol::protocol::{Decodable, Encodable, HeaderVersion, StrBytes};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::frame::{admit, Admitted, Close, Frame, Held, Reader};
use super::groups::Caller;
use super::log::valid_topic_name;
use super::shape::{Refused, Shape};
use super::timestamps::Limits;
use super::{admin, fetch, produce, Broker, Gone};

/// The APIs and versions served: those without topic IDs.
pub const SUPPORTED: &[(ApiKey, i16, i16)] = &[
    (ApiKey::Produce, 3, 11),
    (ApiKey::Fetch, 4, 12),
    (ApiKey::ListOffsets, 1, 7),
    (ApiKey::Metadata, 0, 12),
    (ApiKey::ApiVersions, 0, 3),
    (ApiKey::FindCoordinator, 0, 4),
    (ApiKey::JoinGroup, 0, 7),
    (ApiKey::SyncGroup, 0, 5),
    (ApiKey::Heartbeat, 0, 4),
    (ApiKey::LeaveGroup, 0, 5),
    (ApiKey::OffsetCommit, 2, 8),
    (ApiKey::OffsetFetch, 1, 7),
    (ApiKey::DescribeGroups, 0, 5),
    (ApiKey::ListGroups, 0, 5),
    (ApiKey::CreateTopics, 2, 6),
    (ApiKey::DeleteGroups, 0, 2),
];

/// How many times `max_message_bytes` of records (decompressed, or as stored
/// when not compressed) one `ListOffsets` request may read for their
/// timestamps. Producers fill a batch with at most `batch.size` of records
/// before compressing it (16 KiB by default, and the batch itself is at most
/// `max.message.bytes`), so a batch Kafka's clients made decompresses to far
/// less; a batch that would take more (a compression bomb), or one met once
/// the request has read that much (past batches whose headers claimed a
/// newer record than they held), is answered at batch granularity.
const READ_PER_LOOKUP: usize = 64;

pub fn supported(key: ApiKey, version: i16) -> bool {
    SUPPORTED
        .iter()
        .any(|&(k, lo, hi)| k == key && (lo..=hi).contains(&version))
}

/// Accepts connections until `stop`, then waits for every connection to end.
///
/// At most `max_connections` are open at once: when every place is taken,
/// none is accepted until one ends (they wait in the listen backlog, as
/// Kafka's acceptor waits for a connection slot at `max.connections`), so
/// connections cannot take every descriptor the process has. When accepting
/// fails for want of something the process lacks (descriptors, memory), the
/// loop pauses before trying again: see [`accept_loop`].
pub async fn accept(listener: TcpListener, broker: Arc<Broker>, stop: CancellationToken) {
    let places = broker.connections.clone();
    let serving = stop.clone();
    accept_loop(listener, places, stop, move |stream: TcpStream, place| {
        let _ = stream.set_nodelay(true);
        let (broker, stop) = (broker.clone(), serving.clone());
        let open = Open::new(broker.clone());
        async move {
            serve(stream, broker, stop).await;
            drop((open, place));
        }
    })
    .await
}

/// Counts a connection open from its accept until its task ends, however it
/// ends (`Broker::open_connections`).
struct Open(Arc<Broker>);

impl Open {
    fn new(broker: Arc<Broker>) -> Open {
        broker.open.fetch_add(1, Ordering::Relaxed);
        Open(broker)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What an accept loop takes connections from: a listener (or a stand-in).
pub trait Accept {
    type Conn;
    fn accept(&self) -> impl Future<Output = std::io::Result<Self::Conn>> + Send + '_;
}

impl Accept for TcpListener {
    type Conn = TcpStream;
    async fn accept(&self) -> std::io::Result<TcpStream> {
        TcpListener::accept(self).await.map(|(stream, _)| stream)
    }
}

/// The first pause after an accept fails, doubled at each failure in a row.
pub const ACCEPT_PAUSE_MIN: Duration = Duration::from_millis(10);
/// The longest pause after an accept fails (hyper and axum pause 1 s).
pub const ACCEPT_PAUSE_MAX: Duration = Duration::from_secs(1);

/// Accepts from `listener` until `stop`, each connection served by
/// `serve` (with its place among `places`, to drop when it ends) in a task
/// of its own; then drops the listener and waits for every connection to
/// end.
///
/// A place is taken before accepting: with none free, nothing is accepted
/// until a connection ends. An accept that fails for the connection's sake
/// (it was reset or aborted before it was taken) or the network's (down or
/// unreachable, which Linux's accept(2) asks to retry) is retried at once;
/// any other failure (`EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM`: the process is
/// out of something, and accepting fails at once until something is given
/// back) pauses the loop, [`ACCEPT_PAUSE_MIN`] doubling to
/// [`ACCEPT_PAUSE_MAX`] while it keeps failing, instead of spinning a worker
/// and a log line per try.
pub async fn accept_loop<L, S>(
    listener: L,
    places: Arc<Semaphore>,
    stop: CancellationToken,
    mut serve: impl FnMut(L::Conn, OwnedSemaphorePermit) -> S,
) where
    L: Accept,
    S: Future<Output = ()> + Send + 'static,
{
    use std::io::ErrorKind;
    let mut connections = JoinSet::new();
    let mut pause = ACCEPT_PAUSE_MIN;
    'accepting: loop {
        let place = tokio::select! {
            _ = stop.cancelled() => break,
            place = places.clone().acquire_owned() => match place {
                Ok(place) => place,
                Err(_) => break, // closed: no connection is taken again
            },
            // Reap finished connections as they end.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        loop {
            tokio::select! {
                _ = stop.cancelled() => break 'accepting,
                accepted = listener.accept() => match accepted {
                    Ok(conn) => {
                        pause = ACCEPT_PAUSE_MIN;
                        connections.spawn(serve(conn, place));
                        break;
                    }
                    Err(e) if matches!(
                        e.kind(),
                        ErrorKind::ConnectionAborted
                            | ErrorKind::ConnectionReset
                            | ErrorKind::ConnectionRefused
                            | ErrorKind::Interrupted
                            | ErrorKind::WouldBlock
                            | ErrorKind::NetworkDown
                            | ErrorKind::NetworkUnreachable
                            | ErrorKind::HostUnreachable
                    ) => {
                        // The connection's own trouble, or the network's
                        // (Linux's accept(2) asks that these be retried as
                        // EAGAIN is): nothing the process lacks.
                        tracing::debug!(error = %e, "a connection went before it was accepted");
                    }
                    Err(e) => {
                        tracing::warn!(
                            error = %e,
                            pause_ms = pause.as_millis() as u64,
                            "accept failed; pausing before trying again"
                        );
                        tokio::select! {
                            _ = stop.cancelled() => break 'accepting,
                            _ = tokio::time::sleep(pause) => {}
                        }
                        pause = (pause * 2).min(ACCEPT_PAUSE_MAX);
                    }
                },
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// Serves one connection: reads a request, answers it, reads the next. While
/// a request is in flight the connection reads nothing more, as Kafka's
/// broker mutes it: what the client pipelines waits in the socket (the
/// connection holds no more than the request in flight), and is read and
/// answered in order once the answer before it is written. The socket is
/// only watched meanwhile for the client hanging up, whatever it sent that
/// is still unread, so a client that hangs up is seen at once: its waiting
/// request is dropped, which cancels it.
///
/// A connection is closed, with a log line, when a frame is refused (its size
/// or shape; see [`super::shape`]), when a frame takes longer than
/// `frame_timeout` to arrive, when there is no memory to decode it within
/// `frame_timeout`, when its answer is not read within `frame_timeout`, or
/// when no request comes for `idle_timeout`; and, as Kafka closes it, when an
/// `acks=0` produce fails.
async fn serve(stream: TcpStream, broker: Arc<Broker>, stop: CancellationToken) {
    let peer = stream.peer_addr().ok();
    let (mut rd, mut wr) = stream.into_split();
    let config = &broker.config;
    let mut reader = Reader::new(broker.budget.clone(), config.max_request_bytes);
    loop {
        let frame = match next_frame(&mut reader, &mut rd, &broker, &stop).await {
            Ok(f) => f,
            Err(close) => return closed(&broker, peer, close),
        };
        // Waiting for memory to decode it is bounded like the frame's arrival.
        let deadline = Instant::now() + config.frame_timeout;
        let admitted = tokio::select! {
            a = admit(frame, &broker.budget, config.max_decoded_bytes) => match a {
                Ok(a) => a,
                Err(close) => return closed(&broker, peer, close),
            },
            _ = tokio::time::sleep_until(deadline) => {
                return closed(&broker, peer, Close::Refused(Refused("no memory for the request in time".into())));
            }
            _ = stop.cancelled() => return,
        };
        // The request's task takes the frame: a request that waits lets go
        // of it once decoded (see `Held::keep`).
        let Admitted {
            bytes,
            shape,
            charge,
            answer: held,
        } = admitted;
        let work = answer(&broker, peer, bytes, shape, &charge, &held);
        tokio::pin!(work);
        let reply = tokio::select! {
            // The request first: one answered at once never watches.
            biased;
            reply = &mut work => reply,
            () = hung_up(&mut rd) => {
                broker
                    .stats
                    .connections_dropped_while_waiting
                    .fetch_add(1, Ordering::Relaxed);
                return; // drops `work`: its waiting request is cancelled
            }
        };
        match reply {
            Ok(Some(bytes)) => {
                // A client that does not read its answers would keep this
                // request's memory for ever: it gets `frame_timeout`. (Not
                // cut short at shutdown: shutdown writes what it answered.)
                let written =
                    tokio::time::timeout(config.frame_timeout, wr.write_all(&bytes)).await;
                match written {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => return,
                    Err(_) => {
                        let why = Refused("the answer was not read in time".into());
                        return closed(&broker, peer, Close::Refused(why));
                    }
                }
            }
            Ok(None) => {}
            Err(_) => return,
        }
        // `charge` and `held` end here: the frame's memory and the answer's
        // go back once the answer is written.
    }
}

/// Resolves once the peer has hung up (or the socket failed), whether or not
/// bytes it sent are still unread.
async fn hung_up(rd: &mut OwnedReadHalf) {
    // Nothing unread (the common case): the end of the stream is what the
    // next read finds.
    let mut probe = [0u8; 1];
    match rd.peek(&mut probe).await {
        Ok(0) | Err(_) => return,
        Ok(_) => {}
    }
    // The client pipelined more behind the waiting request: that stays
    // unread, in the socket, and hides the end of the stream from reads.
    hung_up_behind_unread(rd).await
}

/// Waits for the end of the stream behind unread bytes without touching the
/// connection's own readiness (the read after the answer needs it): on a
/// second registration of the socket, a duplicate of its descriptor (held
/// only while a request waits with bytes behind it), each arrival of more
/// bytes wakes it once and the end of the stream ends it.
#[cfg(unix)]
async fn hung_up_behind_unread(rd: &OwnedReadHalf) {
    use std::os::fd::AsFd;
    use tokio::io::Interest;
    let watch = rd
        .as_ref()
        .as_fd()
        .try_clone_to_owned()
        .and_then(|fd| TcpStream::from_std(std::net::TcpStream::from(fd)));
    let Ok(watch) = watch else {
        // No descriptor to spare: the request ends in its own time.
        tracing::debug!("cannot watch a waiting connection for its hang-up");
        return std::future::pending().await;
    };
    loop {
        match watch.ready(Interest::READABLE).await {
            Ok(ready) if !ready.is_read_closed() => {
                // Seen: wait for the next event, on this registration only.
                let _ = watch.try_io(Interest::READABLE, || {
                    Err::<(), _>(std::io::ErrorKind::WouldBlock.into())
                });
            }
            _ => return,
        }
    }
}

/// Elsewhere than on Unix the end of a stream behind unread bytes is not
/// seen: the request ends in its own time.
#[cfg(not(unix))]
async fn hung_up_behind_unread(_: &OwnedReadHalf) {
    std::future::pending().await
}

/// Reads the next frame, closing an idle connection and one whose frame
/// takes too long to arrive.
async fn next_frame(
    reader: &mut Reader,
    rd: &mut OwnedReadHalf,
    broker: &Broker,
    stop: &CancellationToken,
) -> Result<Frame, Close> {
    let idle_since = Instant::now();
    loop {
        let deadline = match reader.started() {
            Some(t) => t + broker.config.frame_timeout,
            None => idle_since + broker.config.idle_timeout,
        };
        tokio::select! {
            read = reader.step(rd) => {
                if let Some(frame) = read? {
                    return Ok(frame);
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                return Err(Close::Refused(Refused(if reader.started().is_some() {
                    "the frame did not arrive in time".into()
                } else {
                    "idle".into()
                })));
            }
            _ = stop.cancelled() => return Err(Close::Gone),
        }
    }
}

/// Logs why a connection is closed, and counts it.
fn closed(broker: &Broker, peer: Option<SocketAddr>, close: Close) {
    if let Close::Refused(why) = close {
        broker
            .stats
            .connections_refused
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(?peer, reason = %why, "connection closed");
    }
}

/// Decodes a request and answers it: the encoded response frame, `None` when
/// no answer is due (`acks=0`), `Err` to close the connection. `charge` holds
/// what the frame and its decoding were charged; a request that waits cuts it
/// down to what it keeps once it has let go of the frame (the frame's bytes
/// go with the last slice of them: the decoded request's). `held` holds what
/// the answer is charged.
async fn answer(
    broker: &Broker,
    peer: Option<SocketAddr>,
    mut frame: Bytes,
    shape: Shape,
    charge: &Held,
    held: &Held,
) -> Result<Option<BytesMut>, Gone> {
    broker.stats.requests.fetch_add(1, Ordering::Relaxed);
    let (Some(key), version) = (shape.key, shape.version) else {
        return Err(Gone);
    };
    let header =
        RequestHeader::decode(&mut frame, key.request_header_version(version)).map_err(|_| Gone)?;
    let id = header.correlation_id;
    // A join's member id begins with the client id, as Kafka's do (cut
    // short and kept to plain characters); the group keeps the client id
    // and address, for DescribeGroups. Taken now: the header is a slice of
    // the frame, and what the group keeps must not hold the frame.
    let caller = (key == ApiKey::JoinGroup).then(|| Caller {
        prefix: (header.client_id.as_deref().unwrap_or("member").chars())
            .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            .take(64)
            .collect(),
        client_id: StrBytes::from_string(header.client_id.as_deref().unwrap_or("").to_string()),
        host: StrBytes::from_string(peer.map_or_else(String::new, |p| java_host(p.ip()))),
    });
    drop(header);
    if !supported(key, version) {
        if key == ApiKey::ApiVersions {
            // Kafka's answer to an ApiVersions it cannot parse: version 0,
            // UNSUPPORTED_VERSION, and the versions it does serve.
            let r = api_versions().with_error_code(ResponseError::UnsupportedVersion.code());
            return encode(id, 0, &r).map(Some);
        }
        tracing::debug!(?key, version, "unsupported request version");
        return Err(Gone);
    }
    // An answer the coordinator builds from what it holds is charged to the
    // budget, in `held`, by this, before it is built.
    let charge_answer = |bytes: usize| broker.budget.try_charge(bytes, held);
    match key {
        ApiKey::ApiVersions => {
            let request: ApiVersionsRequest = decode(frame, version)?;
            // Kafka (KIP-511): from version 3 the client names its software
            // and version, each matching
            // `[a-zA-Z0-9](?:[a-zA-Z0-9\-.]*[a-zA-Z0-9])?`, or the request is
            // answered INVALID_REQUEST, without the versions.
            let r = if version >= 3
                && !(software_label(&request.client_software_name)
                    && software_label(&request.client_software_version))
            {
                ApiVersionsResponse::default().with_error_code(ResponseError::InvalidRequest.code())
            } else {
                api_versions()
            };
            encode(id, version, &r).map(Some)
        }
        ApiKey::Metadata => {
            let r = metadata(broker, &decode(frame, version)?, version, held)?;
            encode(id, version, &r).map(Some)
        }
        ApiKey::ListOffsets => {
            let r = list_offsets(broker, &decode(frame, version)?);
            encode(id, version, &r).map(Some)
        }
        ApiKey::Produce => {
            match produce::handle(broker, decode(frame, version)?, version, charge).await? {
                Some(r) => encode(id, version, &r).map(Some),
                None => Ok(None),
            }
        }
        ApiKey::Fetch => {
            let r = fetch::handle(broker, decode(frame, version)?, charge, held).await?;
            encode(id, version, &r).map(Some)
        }
        ApiKey::FindCoordinator => {
            let r = find_coordinator(broker, &decode(frame, version)?, version);
            encode(id, version, &r).map(Some)
        }
        ApiKey::JoinGroup => {
            let r = broker
                .groups
                .join(
                    decode(frame, version)?,
                    version,
                    caller.as_ref().ok_or(Gone)?,
                    |kept| charge.keep(kept),
                )
                .await?;
            // The request is gone (what the group keeps of it is copied), and
            // its frame with it but for the member id an error answer may
            // share, dropped with that answer once encoded. A leader's answer
            // carries every member's metadata: charged first, from the
            // request's own charge and then the budget (see `charged`), or
            // answered COORDINATOR_LOAD_IN_PROGRESS, which clients retry (a
            // member of a round that completed gets the same generation back
            // when it joins again).
            match charged(broker, charge, held, &r, version)? {
                Some(size) => encode_sized(id, version, &r, size).map(Some),
                None => {
                    let r = JoinGroupResponse::default()
                        .with_error_code(ResponseError::CoordinatorLoadInProgress.code())
                        .with_generation_id(-1)
                        .with_member_id(r.member_id);
                    encode(id, version, &r).map(Some)
                }
            }
        }
        ApiKey::SyncGroup => {
            let r = broker
                .groups
                .sync(decode(frame, version)?, |kept| charge.keep(kept))
                .await?;
            // The request is gone, its frame with it (as for a join).
            // The answer carries the member's assignment: charged first, or
            // answered COORDINATOR_NOT_AVAILABLE, the coordinator's answer to
            // a sync with no room (Java's consumer takes any error it does
            // not expect from a sync, COORDINATOR_LOAD_IN_PROGRESS among
            // them, as fatal; on this one it looks the coordinator up and
            // joins again, and a follower in a stable group gets its
            // generation back).
            match charged(broker, charge, held, &r, version)? {
                Some(size) => encode_sized(id, version, &r, size).map(Some),
                None => {
                    let r = SyncGroupResponse::default()
                        .with_error_code(ResponseError::CoordinatorNotAvailable.code());
                    encode(id, version, &r).map(Some)
                }
            }
        }
        ApiKey::Heartbeat => {
            let r = broker.groups.heartbeat(&decode(frame, version)?);
            encode(id, version, &r).map(Some)
        }
        ApiKey::LeaveGroup => {
            let r = broker.groups.leave(&decode(frame, version)?, version);
            encode(id, version, &r).map(Some)
        }
        ApiKey::OffsetCommit => {
            let r = broker
                .groups
                .commit(&decode(frame, version)?, |topic, index| {
                    broker.topics.partition(topic, index).is_some()
                });
            encode(id, version, &r).map(Some)
        }
        ApiKey::OffsetFetch => {
            let r =
                broker
                    .groups
                    .fetch_offsets(&decode(frame, version)?, version, charge_answer)?;
            encode(id, version, &r).map(Some)
        }
        ApiKey::CreateTopics => {
            let r = admin::create_topics(broker, &decode(frame, version)?, version, held)?;
            // Made at its size: the charge counted it once.
            let size = r.compute_size(version).map_err(|_| Gone)?;
            encode_sized(id, version, &r, size + 16).map(Some)
        }
        ApiKey::ListGroups => {
            let r = broker
                .groups
                .list_groups(&decode(frame, version)?, charge_answer);
            encode(id, version, &r).map(Some)
        }
        ApiKey::DescribeGroups => {
            let r = broker
                .groups
                .describe_groups(&decode(frame, version)?, charge_answer)?;
            encode(id, version, &r).map(Some)
        }
        ApiKey::DeleteGroups => {
            let r = broker
                .groups
                .delete_groups(&decode(frame, version)?, charge_answer)?;
            encode(id, version, &r).map(Some)
        }
        _ => Err(Gone),
    }
}

/// Decodes the rest of the frame (taken: once the request is decoded, only
/// its own slices of the frame hold the frame's bytes).
fn decode<T: Decodable>(mut frame: Bytes, version: i16) -> Result<T, Gone> {
    T::decode(&mut frame, version).map_err(|e| {
        tracing::debug!(error = %e, "undecodable request");
        Gone
    })
}

/// What a group answer's frame takes, charged to the budget in `held` (its
/// size), or `None` when the budget has no room for it now. Join and sync
/// answers are built from what the group keeps (a leader's join answer from
/// every member's metadata, a sync answer from the member's assignment),
/// not from the request: a request of a few dozen bytes may be answered
/// with megabytes, sent again for every such request, and held until it is
/// written (up to `frame_timeout` for a client that does not read). What is
/// built shares the group's bytes; its encoding copies them, and is what is
/// charged, before it is made: first from what the request itself was
/// charged (`charge`, let go of whole here: the request is gone), so that an
/// answer no larger than its request is never refused, then from the
/// budget, without waiting. An answer that cannot be encoded closes the
/// connection, as any other would.
fn charged<T: Encodable>(
    broker: &Broker,
    charge: &Held,
    held: &Held,
    body: &T,
    version: i16,
) -> Result<Option<usize>, Gone> {
    // The frame's size and the response header, with room to spare.
    const HEAD: usize = 16;
    let size = body
        .compute_size(version)
        .ok()
        .and_then(|n| n.checked_add(HEAD))
        .ok_or(Gone)?;
    let passed = charge.pass_to(held, size);
    charge.keep(0);
    if passed == size || broker.budget.try_charge(size - passed, held) {
        Ok(Some(size))
    } else {
        tracing::debug!(size, "a group answer has no room in the memory budget");
        Ok(None)
    }
}

/// A response frame: size, header, body.
fn encode<T: Encodable + HeaderVersion>(
    correlation_id: i32,
    version: i16,
    body: &T,
) -> Result<BytesMut, Gone> {
    encode_sized(correlation_id, version, body, 0)
}

/// A response frame in a buffer made `capacity` bytes at once (the frame's
/// size, charged: see [`charged`]), so it does not grow past it by doubling.
fn encode_sized<T: Encodable + HeaderVersion>(
    correlation_id: i32,
    version: i16,
    body: &T,
    capacity: usize,
) -> Result<BytesMut, Gone> {
    let mut out = BytesMut::with_capacity(capacity);
    out.put_i32(0); // the size, written below
    ResponseHeader::default()
        .with_correlation_id(correlation_id)
        .encode(&mut out, T::header_version(version))
        .map_err(|_| Gone)?;
    body.encode(&mut out, version).map_err(|e| {
        tracing::warn!(error = %e, "response did not encode");
        Gone
    })?;
    let size = (out.len() - 4) as i32;
    out[..4].copy_from_slice(&size.to_be_bytes());
    Ok(out)
}

/// A client's address as Kafka shows it (Java's `InetAddress.toString` with
/// no host name): `/127.0.0.1`, and an IPv6 address as eight groups in hex,
/// none left out (`/0:0:0:0:0:0:0:1`). An IPv4 client of a socket listening
/// on IPv6 (`::ffff:127.0.0.1`) is shown as IPv4, as Java shows it.
pub(crate) fn java_host(ip: std::net::IpAddr) -> String {
    match ip.to_canonical() {
        std::net::IpAddr::V4(v4) => format!("/{v4}"),
        std::net::IpAddr::V6(v6) => {
            let groups: Vec<String> = v6.segments().iter().map(|g| format!("{g:x}")).collect();
            format!("/{}", groups.join(":"))
        }
    }
}

/// A client software name or version as Kafka accepts it: letters, digits,
/// '-' and '.', beginning and ending with a letter or digit.
fn software_label(s: &str) -> bool {
    let b = s.as_bytes();
    b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
        && b.iter()
            .all(|&c| c.is_ascii_alphanumeric() || c == b'-' || c == b'.')
}

fn api_versions() -> ApiVersionsResponse {
    ApiVersionsResponse::default().with_api_keys(
        SUPPORTED
            .iter()
            .map(|&(k, lo, hi)| {
                ApiVersion::default()
                    .with_api_key(k as i16)
                    .with_min_version(lo)
                    .with_max_version(hi)
            })
            .collect(),
    )
}

/// The leader is node 0 (this broker); followers are nodes 1..=n, listed as
/// replicas and in-sync replicas but not as brokers (nobody can reach them).
///
/// The answer grows with what the broker holds, not with the request (every
/// topic for a few bytes), and is held until it is written: it is charged to
/// the memory budget first, in `held`, as fetch and offset fetch answers are
/// (what building and writing it takes: each topic's and partition's entry,
/// and its name and node lists twice, built and encoded). When the budget has
/// no room for it the connection is closed (Metadata has no error of its own
/// to say so); the client connects again and asks again.
fn metadata(
    broker: &Broker,
    request: &MetadataRequest,
    version: i16,
    held: &Held,
) -> Result<MetadataResponse, Gone> {
    const TOPIC: usize = std::mem::size_of::<MetadataResponseTopic>() + 32;
    const PARTITION: usize = std::mem::size_of::<MetadataResponsePartition>() + 64;
    // Every topic: null from version 1, an empty list in version 0. Kafka
    // answers an empty list from version 1 with no topics.
    let all = match &request.topics {
        None => true,
        Some(ts) => ts.is_empty() && version == 0,
    };
    // From version 12 topics may be asked for by ID; Kafka then answers by
    // ID alone. This broker gives its topics no IDs, so each ID asked for is
    // answered once, UNKNOWN_TOPIC_ID, as Kafka answers one it does not know.
    let mut ids = std::collections::HashSet::new();
    let unknown_ids: Vec<_> = request
        .topics
        .iter()
        .flatten()
        .filter(|t| version >= 12 && !t.topic_id.is_nil() && ids.insert(t.topic_id))
        .map(|t| {
            MetadataResponseTopic::default()
                .with_topic_id(t.topic_id)
                .with_name(None)
                .with_error_code(ResponseError::UnknownTopicId.code())
        })
        .collect();
    // Each topic with its name as asked for; `None` for every topic's,
    // copied from the topic once the answer is charged.
    let topics: Vec<(Option<TopicName>, Option<Arc<super::log::Topic>>)> =
        if !unknown_ids.is_empty() {
            Vec::new()
        } else if all {
            broker
                .topics
                .all()
                .into_iter()
                .map(|t| (None, Some(t)))
                .collect()
        } else {
            // A topic unknown here is created if the broker creates topics on
            // first use and the request allows it (from version 4; before, it
            // always does).
            // Each name once, as Kafka does: the answer grows with distinct
            // topics, not with how often a request repeats one.
            let create = request.allow_auto_topic_creation;
            let mut seen = std::collections::HashSet::new();
            request
                .topics
                .iter()
                .flatten()
                .filter_map(|t| t.name.as_ref())
                .filter(|name| seen.insert(&***name))
                .map(|name| {
                    (
                        Some(name.clone()),
                        broker.topics.get_or_create(name, create),
                    )
                })
                .collect()
        };
    let nodes = 2 * 8 * (broker.config.followers + 1);
    let bytes: usize = topics
        .iter()
        .map(|(name, topic)| {
            let name =
                topic.as_ref().map_or(0, |t| t.name.len()) + name.as_ref().map_or(0, |n| n.len());
            TOPIC
                + 2 * name
                + topic.as_ref().map_or(0, |t| t.partitions.len()) * (PARTITION + nodes)
        })
        .sum();
    if !broker.budget.try_charge(bytes, held) {
        tracing::debug!(bytes, "a metadata answer has no room in the memory budget");
        return Err(Gone);
    }
    let replicas: Vec<BrokerId> = (0..=broker.config.followers as i32).map(BrokerId).collect();
    let (host, port) = &broker.advertised;
    Ok(MetadataResponse::default()
        .with_brokers(vec![MetadataResponseBroker::default()
            .with_node_id(BrokerId(0))
            .with_host(StrBytes::from_string(host.clone()))
            .with_port(*port)])
        .with_cluster_id(Some(StrBytes::from_static_str("tokio-purgatory")))
        .with_controller_id(BrokerId(0))
        .with_topics(
            topics
                .into_iter()
                .map(|(name, topic)| {
                    let name = name.unwrap_or_else(|| {
                        let t = topic.as_ref().map_or("", |t| &*t.name);
                        TopicName(StrBytes::from_string(t.to_string()))
                    });
                    // Kafka answers a topic it does not have whose name it
                    // would refuse (`Topic.validate`) INVALID_TOPIC_EXCEPTION,
                    // whether or not the request allows creation.
                    let missing = if valid_topic_name(&name) {
                        ResponseError::UnknownTopicOrPartition
                    } else {
                        ResponseError::InvalidTopicException
                    };
                    let t = MetadataResponseTopic::default().with_name(Some(name));
                    match topic {
                        None => t.with_error_code(missing.code()),
                        Some(topic) => t.with_partitions(
                            topic
                                .partitions
                                .iter()
                                .map(|p| {
                                    MetadataResponsePartition::default()
                                        .with_partition_index(p.index)
                                        .with_leader_id(BrokerId(0))
                                        .with_replica_nodes(replicas.clone())
                                        .with_isr_nodes(isr_nodes(p))
                                })
                                .collect(),
                        ),
                    }
                })
                .chain(unknown_ids)
                .collect(),
        ))
}

/// This broker (node 0) coordinates every group (key type 0). It serves no
/// transactions: a transaction coordinator lookup (1) is answered
/// TRANSACTIONAL_ID_AUTHORIZATION_FAILED, Kafka's answer to a client that
/// may not use that transactional id here (its `FindCoordinator` checks
/// DESCRIBE on the id first), which is so for every id here. It is not
/// retriable, so clients fail at once (aiokafka's transactional `start()`
/// raises it; Java's and librdkafka's producers take it as fatal), where the
/// retriable COORDINATOR_NOT_AVAILABLE had aiokafka retry for ever. No
/// share coordinator (2): COORDINATOR_NOT_AVAILABLE. Any other key type is
/// one Kafka does not know (`CoordinatorType.forId` throws), answered
/// INVALID_REQUEST, for every key from version 4.
fn find_coordinator(
    broker: &Broker,
    request: &FindCoordinatorRequest,
    version: i16,
) -> FindCoordinatorResponse {
    use kafka_protocol::messages::find_coordinator_response::Coordinator;
    let (host, port) = &broker.advertised;
    let host = StrBytes::from_string(host.clone());
    let error = match request.key_type {
        0 => None,
        1 => Some(ResponseError::TransactionalIdAuthorizationFailed),
        2 => Some(ResponseError::CoordinatorNotAvailable),
        _ => Some(ResponseError::InvalidRequest),
    };
    let code = error.map_or(0, |e| e.code());
    // An error names no node: Kafka's `Node.noNode()`, id -1, host "" and
    // port -1 (not this broker's address).
    let (node, host, port) = match error {
        None => (BrokerId(0), host, *port),
        Some(_) => (BrokerId(-1), StrBytes::default(), -1),
    };
    if version >= 4 {
        FindCoordinatorResponse::default().with_coordinators(
            request
                .coordinator_keys
                .iter()
                .map(|k| {
                    Coordinator::default()
                        .with_key(k.clone())
                        .with_node_id(node)
                        .with_host(host.clone())
                        .with_port(port)
                        .with_error_code(code)
                })
                .collect(),
        )
    } else {
        FindCoordinatorResponse::default()
            .with_error_code(code)
            .with_node_id(node)
            .with_host(host)
            .with_port(port)
    }
}

/// The leader (node 0) and the followers (nodes 1..) in the partition's ISR.
fn isr_nodes(p: &super::Partition) -> Vec<BrokerId> {
    std::iter::once(0)
        .chain(p.in_sync_followers().into_iter().map(|f| f as i32 + 1))
        .map(BrokerId)
        .collect()
}

/// Latest (-1) is the high watermark, earliest (-2) the log start, max
/// timestamp (-3, from version 7) the first record with the newest
/// timestamp, earliest local (-4) the log start too (Kafka's answer without
/// tiered storage, whatever the version: all of a log here is local); a
/// timestamp finds the first record at least that new, answered with its
/// offset and timestamp, or offset -1 and timestamp -1 when there is none,
/// as Kafka does. Both read records inside their batch, decompressing it if
/// need be: what a batch's codec keeps is charged to the memory budget while
/// that batch is read, and one request reads at most [`READ_PER_LOOKUP`]
/// times `max_message_bytes` of records, decompressed or not, across all the
/// partitions it names (what a codec makes before it can be read, a snappy
/// block or an LZ4 frame's buffers, counted whole before it is made); a
/// batch past either, and any zstd batch, is answered at batch granularity
/// (its first offset). A partition named
/// twice is answered INVALID_REQUEST at each mention, as Kafka answers it.
fn list_offsets(broker: &Broker, request: &ListOffsetsRequest) -> ListOffsetsResponse {
    let mut limits = Limits {
        read_left: broker
            .config
            .max_message_bytes
            .saturating_mul(READ_PER_LOOKUP),
        budget: &broker.budget,
    };
    // Each distinct topic looked up once; how often each partition is named.
    let mut topic_at: HashMap<&str, usize> = HashMap::new();
    let mut found = Vec::new();
    let mut named: HashMap<(usize, i32), u32> = HashMap::new();
    let at: Vec<usize> = request
        .topics
        .iter()
        .map(|t| {
            let ti = *topic_at.entry(t.name.as_str()).or_insert_with(|| {
                found.push(broker.topics.get(&t.name));
                found.len() - 1
            });
            for p in &t.partitions {
                *named.entry((ti, p.partition_index)).or_default() += 1;
            }
            ti
        })
        .collect();
    let mut answer = |ti: usize, p: &ListOffsetsPartition| {
        let r = ListOffsetsPartitionResponse::default()
            .with_partition_index(p.partition_index)
            .with_timestamp(-1)
            .with_offset(-1);
        if named[&(ti, p.partition_index)] > 1 {
            return r.with_error_code(ResponseError::InvalidRequest.code());
        }
        let part = found[ti].as_ref().and_then(|t| {
            usize::try_from(p.partition_index)
                .ok()
                .and_then(|i| t.partitions.get(i))
        });
        let Some(part) = part else {
            return r.with_error_code(ResponseError::UnknownTopicOrPartition.code());
        };
        let found = match p.timestamp {
            -1 => Some((part.high_watermark(), -1)),
            -2 | -4 => Some((part.log_start(), -1)),
            -3 => part.newest_timestamp(&mut limits),
            ts if ts >= 0 => part.offset_for_time(ts, &mut limits),
            // Other negative timestamps name nothing this broker serves.
            _ => None,
        };
        // Kafka answers "no such record" with offset -1 and timestamp -1, no
        // error.
        let (offset, ts) = found.map_or((-1, -1), |(o, ts)| (o as i64, ts));
        r.with_offset(offset).with_timestamp(ts)
    };
    ListOffsetsResponse::default().with_topics(
        request
            .topics
            .iter()
            .zip(at)
            .map(|(t, ti)| {
                ListOffsetsTopicResponse::default()
                    .with_name(t.name.clone())
                    .with_partitions(t.partitions.iter().map(|p| answer(ti, p)).collect())
            })
            .collect(),
    )
}
