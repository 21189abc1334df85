// Package s3test runs an S3-compatible server on loopback for tests and
// benchmarks: gofakes3 (github.com/johannesboyne/gofakes3, MIT), a real
// implementation of the S3 REST protocol (path-style and virtual-hosted
// buckets, ListObjectsV2, HEAD, ranged GET, object versions) over an
// in-memory backend, served over real HTTP.
//
// gofakes3 keeps no additional checksums: it never answers
// x-amz-checksum-sha256. Server fills that gap in one documented place: a
// thin layer over the same server adds x-amz-checksum-sha256 and
// x-amz-checksum-type to HEAD and GET responses of the objects a test gave
// a checksum with SetChecksum, as AWS S3 does for objects uploaded with
// SHA-256 checksums. Nothing else is faked; gofakes3 also does not check
// request signatures, so Server records whether each request carried one.
package s3test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"net"
	"net/http"
	"strings"
	"sync"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
)

// Request is what Server saw of one request.
type Request struct {
	Method, Host, Path, Range string
	// Signed says the request carried an Authorization header.
	Signed bool
}

// Checksum is what SetChecksum makes the server announce for an object.
type Checksum struct {
	SHA256 string // base64, as in x-amz-checksum-sha256
	Type   string // FULL_OBJECT or COMPOSITE
}

// FullObject is the full-object SHA-256 checksum of data, as S3 keeps it.
func FullObject(data []byte) Checksum {
	sum := sha256.Sum256(data)
	return Checksum{SHA256: base64.StdEncoding.EncodeToString(sum[:]), Type: "FULL_OBJECT"}
}

// Server is a running S3-compatible server.
type Server struct {
	// URL is the endpoint, http://127.0.0.1:PORT.
	URL string
	// Addr is the listening address, 127.0.0.1:PORT.
	Addr string
	// VirtualHostBase is the host (with its port) under which
	// virtual-hosted-style requests are routed: BUCKET.VirtualHostBase. It
	// resolves nowhere: dial Addr instead (DialLoopback).
	VirtualHostBase string

	srv *http.Server
	ln  net.Listener

	mu        sync.Mutex
	checksums map[string]Checksum // "/bucket/key" → announced checksum
	requests  []Request
	wrap      func(http.Handler) http.Handler
}

// Option configures a Server.
type Option func(*Server)

// WithMiddleware puts mw between the listener and the server (after the
// recording and checksum layer), to inject faults.
func WithMiddleware(mw func(http.Handler) http.Handler) Option {
	return func(s *Server) { s.wrap = mw }
}

// Start starts a server on a loopback port.
func Start(opts ...Option) (*Server, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &Server{Addr: ln.Addr().String(), ln: ln, checksums: make(map[string]Checksum)}
	s.URL = "http://" + s.Addr
	_, port, _ := net.SplitHostPort(s.Addr)
	s.VirtualHostBase = "s3.test:" + port
	for _, o := range opts {
		o(s)
	}
	h := gofakes3.New(s3mem.New(), gofakes3.WithHostBucketBase(s.VirtualHostBase)).Server()
	if s.wrap != nil {
		h = s.wrap(h)
	}
	s.srv = &http.Server{Handler: s.record(h)}
	go func() { _ = s.srv.Serve(ln) }()
	return s, nil
}

// Close stops the server.
func (s *Server) Close() error { return s.srv.Close() }

// record notes each request and adds the checksum headers SetChecksum set.
func (s *Server) record(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		path := r.URL.Path
		if bucket, ok := strings.CutSuffix(r.Host, "."+s.VirtualHostBase); ok {
			path = "/" + bucket + path
		}
		s.mu.Lock()
		s.requests = append(s.requests, Request{
			Method: r.Method, Host: r.Host, Path: r.URL.Path, Range: r.Header.Get("Range"),
			Signed: r.Header.Get("Authorization") != "",
		})
		c, ok := s.checksums[path]
		s.mu.Unlock()
		if ok && (r.Method == http.MethodGet || r.Method == http.MethodHead) && r.URL.RawQuery == "" {
			w.Header().Set("x-amz-checksum-sha256", c.SHA256)
			w.Header().Set("x-amz-checksum-type", c.Type)
		}
		next.ServeHTTP(w, r)
	})
}

// SetChecksum makes HEAD and GET of bucket/key announce c.
func (s *Server) SetChecksum(bucket, key string, c Checksum) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.checksums["/"+bucket+"/"+key] = c
}

// Requests returns the requests seen so far.
func (s *Server) Requests() []Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Request(nil), s.requests...)
}

// ResetRequests forgets the requests seen so far.
func (s *Server) ResetRequests() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.requests = nil
}

// Client returns a path-style client with static credentials, to fill
// the server.
func (s *Server) Client() *s3.Client {
	return s3.New(s3.Options{
		Region:       "us-east-1",
		Credentials:  credentials.NewStaticCredentialsProvider("test", "test", ""),
		BaseEndpoint: aws.String(s.URL),
		UsePathStyle: true,
		// gofakes3 does not read aws-chunked uploads with trailing
		// checksums, which the SDK sends by default.
		RequestChecksumCalculation: aws.RequestChecksumCalculationWhenRequired,
	})
}

// CreateBucket creates a bucket, with object versions kept if versioned.
func (s *Server) CreateBucket(ctx context.Context, bucket string, versioned bool) error {
	c := s.Client()
	if _, err := c.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: &bucket}); err != nil {
		return err
	}
	if !versioned {
		return nil
	}
	_, err := c.PutBucketVersioning(ctx, &s3.PutBucketVersioningInput{
		Bucket:                  &bucket,
		VersioningConfiguration: &types.VersioningConfiguration{Status: types.BucketVersioningStatusEnabled},
	})
	return err
}

// Put stores data at bucket/key and returns the object's version id ("" in
// a bucket without versions).
func (s *Server) Put(ctx context.Context, bucket, key string, data []byte) (string, error) {
	out, err := s.Client().PutObject(ctx, &s3.PutObjectInput{Bucket: &bucket, Key: &key, Body: bytes.NewReader(data)})
	if err != nil {
		return "", err
	}
	return aws.ToString(out.VersionId), nil
}

// DialLoopback is a DialContext that connects every address to addr: it
// lets virtual-hosted-style host names (BUCKET.VirtualHostBase) reach the
// server.
func DialLoopback(addr string) func(ctx context.Context, network, _ string) (net.Conn, error) {
	var d net.Dialer
	return func(ctx context.Context, network, _ string) (net.Conn, error) {
		return d.DialContext(ctx, network, addr)
	}
}
