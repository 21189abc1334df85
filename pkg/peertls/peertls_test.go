package peertls

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// newFiles writes a new CA named name into a directory of its own.
func newFiles(t *testing.T, name string) Files {
	t.Helper()
	f, err := WriteCA(t.TempDir(), name)
	require.NoError(t, err)
	return f
}

// handshake connects a client with cc to a server with sc over loopback
// TCP, has each send a byte (in TLS 1.3 the server's verdict on the
// client's certificate comes with it), and returns what each end saw, or
// the first error.
func handshake(sc, cc *tls.Config) (server, client tls.ConnectionState, err error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return server, client, err
	}
	defer ln.Close()
	type result struct {
		st  tls.ConnectionState
		err error
	}
	done := make(chan result, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- result{err: err}
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		tc := tls.Server(c, sc)
		if err = tc.Handshake(); err == nil {
			if _, err = tc.Read(make([]byte, 1)); err == nil {
				_, err = tc.Write([]byte{1})
			}
		}
		done <- result{tc.ConnectionState(), err}
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		return server, client, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	tc := tls.Client(c, cc)
	cerr := tc.Handshake()
	if cerr == nil {
		if _, cerr = tc.Write([]byte{1}); cerr == nil {
			_, cerr = tc.Read(make([]byte, 1))
		}
	}
	if cerr != nil {
		c.Close()
	}
	r := <-done
	if r.err != nil {
		return server, client, r.err
	}
	if cerr != nil {
		return server, client, cerr
	}
	return r.st, tc.ConnectionState(), nil
}

func TestMintedCertificate(t *testing.T) {
	t.Parallel()
	ca := newFiles(t, "cluster CA")
	id, err := New("gpu-node-7.example", ca, WithLifetime(time.Hour))
	require.NoError(t, err)
	c := id.Certificate()
	require.Equal(t, "gpu-node-7.example", c.Subject.CommonName)
	require.Equal(t, []string{"gpu-node-7.example"}, c.DNSNames)
	require.Equal(t, "cluster CA", c.Issuer.CommonName)
	require.ElementsMatch(t, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}, c.ExtKeyUsage)
	require.WithinDuration(t, time.Now().Add(time.Hour), c.NotAfter, time.Minute)

	// A member name that is no DNS name is still the certificate's name.
	odd, err := New("Node_1:7946", ca)
	require.NoError(t, err)
	require.Equal(t, "Node_1:7946", odd.Certificate().Subject.CommonName)
	require.Empty(t, odd.Certificate().DNSNames)
}

func TestMutualTLS(t *testing.T) {
	t.Parallel()
	ca := newFiles(t, "cluster CA")
	a, err := New("node-a", ca)
	require.NoError(t, err)
	b, err := New("node-b", ca)
	require.NoError(t, err)
	srv, cli, err := handshake(a.ServerConfig(), b.ClientConfig())
	require.NoError(t, err)
	require.Equal(t, "node-b", PeerName(&srv))
	require.Equal(t, "node-a", PeerName(&cli))
	require.Equal(t, uint16(tls.VersionTLS13), cli.Version)
	require.Empty(t, PeerName(nil), "plain HTTP has no peer name")

	other, err := New("node-b", newFiles(t, "another CA"))
	require.NoError(t, err)
	_, _, err = handshake(a.ServerConfig(), other.ClientConfig())
	require.Error(t, err, "a client certificate of another CA")
	_, _, err = handshake(other.ServerConfig(), b.ClientConfig())
	require.Error(t, err, "a server certificate of another CA")
	noCert := &tls.Config{InsecureSkipVerify: true}
	_, _, err = handshake(a.ServerConfig(), noCert)
	require.Error(t, err, "no client certificate")
	old := &tls.Config{InsecureSkipVerify: true, MaxVersion: tls.VersionTLS12, GetClientCertificate: b.ClientConfig().GetClientCertificate}
	_, _, err = handshake(a.ServerConfig(), old)
	require.Error(t, err, "TLS 1.2")
}

func TestRenewedWithoutRestart(t *testing.T) {
	t.Parallel()
	ca := newFiles(t, "cluster CA")
	a, err := New("node-a", ca, WithLifetime(time.Second))
	require.NoError(t, err)
	b, err := New("node-b", ca)
	require.NoError(t, err)
	sc, cc := a.ServerConfig(), b.ClientConfig() // made once, as the chunk server and swarm make them
	first := a.Certificate()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() { cancel(); require.NoError(t, <-done) }()

	require.Eventually(t, func() bool { return a.Certificate().SerialNumber.Cmp(first.SerialNumber) != 0 }, 30*time.Second, 10*time.Millisecond)
	_, cli, err := handshake(sc, cc)
	require.NoError(t, err)
	require.NotEqual(t, first.SerialNumber, cli.PeerCertificates[0].SerialNumber, "the server presents the renewed certificate")
}

func TestCARotation(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	oldCA, oldKey, err := NewCA("old CA", time.Hour)
	require.NoError(t, err)
	newCA, newKey, err := NewCA("new CA", time.Hour)
	require.NoError(t, err)
	files := Files{CA: filepath.Join(dir, "ca.crt"), Key: filepath.Join(dir, "ca.key")}
	write := func(ca, key []byte) {
		require.NoError(t, os.WriteFile(files.CA, ca, 0o644))
		require.NoError(t, os.WriteFile(files.Key, key, 0o600))
	}
	peer := func(name string, ca, key []byte) *Identity {
		d := t.TempDir()
		f := Files{CA: filepath.Join(d, "ca.crt"), Key: filepath.Join(d, "ca.key")}
		require.NoError(t, os.WriteFile(f.CA, ca, 0o644))
		require.NoError(t, os.WriteFile(f.Key, key, 0o600))
		id, err := New(name, f)
		require.NoError(t, err)
		return id
	}
	write(oldCA, oldKey)
	a, err := New("node-a", files)
	require.NoError(t, err)
	a.check = 10 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() { cancel(); require.NoError(t, <-done) }()
	sc := a.ServerConfig()

	// 1. The new CA is added to the bundle: a node already signed by it
	// is trusted, while node-a still presents its old certificate.
	both := append(append([]byte{}, oldCA...), newCA...)
	write(both, oldKey)
	early := peer("node-b", both, newKey)
	require.Eventually(t, func() bool { _, _, err := handshake(sc, early.ClientConfig()); return err == nil }, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, "old CA", a.Certificate().Issuer.CommonName)

	// 2. The new key signs: node-a's certificate comes from the new CA.
	write(both, newKey)
	require.Eventually(t, func() bool { return a.Certificate().Issuer.CommonName == "new CA" }, 30*time.Second, 10*time.Millisecond)
	late := peer("node-c", both, oldKey) // it has the bundle, not yet the new key
	_, _, err = handshake(sc, late.ClientConfig())
	require.NoError(t, err, "a node signed by the old CA is trusted while the bundle holds it")

	// 3. The old CA is dropped: its certificates are refused.
	write(newCA, newKey)
	require.Eventually(t, func() bool { _, _, err := handshake(sc, late.ClientConfig()); return err != nil }, 30*time.Second, 10*time.Millisecond)
	_, _, err = handshake(sc, early.ClientConfig())
	require.NoError(t, err)
}

// TestHelmGenCA reads a CA as Helm's genCA makes it: an RSA key in PKCS #1,
// a certificate for key encipherment, signatures and signing certificates.
func TestHelmGenCA(t *testing.T) {
	t.Parallel()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: serial(), Subject: pkix.Name{CommonName: "weightd-peer-ca"},
		NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage:    x509.KeyUsageKeyEncipherment | x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	require.NoError(t, err)
	dir := t.TempDir()
	f := Files{CA: filepath.Join(dir, "ca.crt"), Key: filepath.Join(dir, "ca.key")}
	require.NoError(t, os.WriteFile(f.CA, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644))
	require.NoError(t, os.WriteFile(f.Key, pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}), 0o600))
	a, err := New("node-a", f)
	require.NoError(t, err)
	b, err := New("node-b", f)
	require.NoError(t, err)
	_, _, err = handshake(a.ServerConfig(), b.ClientConfig())
	require.NoError(t, err)
}

func TestBadCA(t *testing.T) {
	t.Parallel()
	one, two := newFiles(t, "one"), newFiles(t, "two")
	for name, tc := range map[string]struct {
		node  string
		files Files
		want  string
	}{
		"no node name":        {"", one, "node name"},
		"no key file":         {"n", Files{CA: one.CA}, "both"},
		"missing CA file":     {"n", Files{CA: one.CA + ".gone", Key: one.Key}, "reading the peer CA"},
		"key of another CA":   {"n", Files{CA: one.CA, Key: two.Key}, "no CA certificate in"},
		"a key as the bundle": {"n", Files{CA: one.Key, Key: one.Key}, "no PEM certificate"},
		"a cert as the key":   {"n", Files{CA: one.CA, Key: one.CA}, "no PEM private key"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := New(tc.node, tc.files)
			require.ErrorContains(t, err, tc.want)
		})
	}
}
