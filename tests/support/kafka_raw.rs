//! Raw Kafka request frames and answers, for the broker example's tests that
//! pipeline requests on one connection or set the header themselves.
//! Included with `#[path]`.
#![allow(dead_code)]

use bytes::BufMut;
use kafka_protocol::messages::{RequestHeader, ResponseHeader};
use kafka_protocol::protocol::{Decodable, Encodable, HeaderVersion, Request, StrBytes};
use tokio::io::AsyncReadExt;

/// A request frame (size, header, body) with correlation id `id` and client
/// id `client`.
pub fn frame_from<R: Request>(client: &str, req: &R, version: i16, id: i32) -> Vec<u8> {
    let mut out = bytes::BytesMut::new();
    out.put_i32(0);
    RequestHeader::default()
        .with_request_api_key(R::KEY)
        .with_request_api_version(version)
        .with_correlation_id(id)
        .with_client_id(Some(StrBytes::from_string(client.to_string())))
        .encode(&mut out, R::header_version(version))
        .unwrap();
    req.encode(&mut out, version).unwrap();
    let size = (out.len() - 4) as i32;
    out[..4].copy_from_slice(&size.to_be_bytes());
    out.to_vec()
}

/// A request frame with correlation id `id` (client id "raw").
pub fn frame<R: Request>(req: &R, version: i16, id: i32) -> Vec<u8> {
    frame_from("raw", req, version, id)
}

/// Reads one answer to an `R` sent at `version`: its correlation id and
/// body; `None` once the broker has closed the connection.
pub async fn read_answer<R: Request>(
    conn: &mut tokio::net::TcpStream,
    version: i16,
) -> Option<(i32, R::Response)> {
    let size = conn.read_i32().await.ok()?;
    let mut body = vec![0; size.clamp(0, 1 << 26) as usize];
    conn.read_exact(&mut body).await.ok()?;
    let mut body = bytes::Bytes::from(body);
    let h = ResponseHeader::decode(&mut body, R::Response::header_version(version)).unwrap();
    Some((
        h.correlation_id,
        R::Response::decode(&mut body, version).unwrap(),
    ))
}
