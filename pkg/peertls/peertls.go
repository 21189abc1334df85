package peertls

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"os"
	"path/filepath"
	"regexp"
	"sync/atomic"
	"time"
)

// Files names the cluster CA an agent holds.
type Files struct {
	// CA is a PEM bundle of the CA certificates peers are trusted by; it
	// may hold several, so that a new CA is trusted before it signs.
	CA string
	// Key is the PEM private key of the CA that signs this agent's
	// certificates: one of CA's, whichever matches it.
	Key string
}

// DefaultLifetime is how long a minted certificate is valid. It is renewed
// at two thirds of it, so a node whose CA was taken from it is trusted at
// most this long after its certificates stop being renewed.
const DefaultLifetime = 24 * time.Hour

// checkEvery is how often the CA files are read again to notice a rotation
// (the kubelet updates a mounted Secret within about a minute).
const checkEvery = 30 * time.Second

// clockSkew backdates a certificate, so that a peer whose clock runs a
// little behind does not find it not yet valid.
const clockSkew = 5 * time.Minute

// Identity is this node's TLS identity among its peers. Its methods are
// safe for concurrent use.
type Identity struct {
	name     string
	files    Files
	lifetime time.Duration
	check    time.Duration // how often the CA files are read again
	log      *slog.Logger
	cur      atomic.Pointer[state]
}

// state is one CA bundle and the certificate minted with it.
type state struct {
	caPEM, keyPEM []byte
	pool          *x509.CertPool
	cert          *tls.Certificate
	renewAt       time.Time
}

// Option configures an Identity.
type Option func(*Identity)

// WithLifetime sets how long each minted certificate is valid
// (DefaultLifetime when not set or not positive).
func WithLifetime(d time.Duration) Option {
	return func(id *Identity) {
		if d > 0 {
			id.lifetime = d
		}
	}
}

// WithLogger sets the logger for renewals and rotations; silent by default.
func WithLogger(l *slog.Logger) Option { return func(id *Identity) { id.log = l } }

// New reads the CA in files and mints a certificate for nodeName.
func New(nodeName string, files Files, opts ...Option) (*Identity, error) {
	if nodeName == "" {
		return nil, errors.New("peer TLS: a node name is needed")
	}
	if files.CA == "" || files.Key == "" {
		return nil, errors.New("peer TLS: both a CA certificate file and a CA key file are needed")
	}
	id := &Identity{name: nodeName, files: files, lifetime: DefaultLifetime, check: checkEvery, log: slog.New(slog.DiscardHandler)}
	for _, o := range opts {
		o(id)
	}
	st, err := id.load()
	if err != nil {
		return nil, err
	}
	id.cur.Store(st)
	return id, nil
}

// NodeName is the name this identity's certificates carry.
func (id *Identity) NodeName() string { return id.name }

// Certificate is the certificate presented now.
func (id *Identity) Certificate() *x509.Certificate { return id.cur.Load().cert.Leaf }

// Run renews the certificate before it expires, and mints a new one as
// soon as the CA files change (a CA added, rotated or removed), until ctx
// ends. A failure keeps the current certificate and is retried.
func (id *Identity) Run(ctx context.Context) error {
	t := time.NewTimer(0)
	defer t.Stop()
	failed := false
	for {
		wait := min(id.check, time.Until(id.cur.Load().renewAt))
		if failed {
			wait = id.check // not again at once
		}
		t.Reset(wait)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		cur := id.cur.Load()
		caPEM, keyPEM, err := id.read()
		changed := err == nil && (!bytes.Equal(caPEM, cur.caPEM) || !bytes.Equal(keyPEM, cur.keyPEM))
		if !changed && time.Now().Before(cur.renewAt) {
			continue
		}
		st, err := id.load()
		if failed = err != nil; failed {
			id.log.Error("renewing the peer certificate; keeping the current one", "expires", cur.cert.Leaf.NotAfter, "err", err)
			continue
		}
		id.cur.Store(st)
		id.log.Info("peer certificate renewed", "node", id.name, "ca_changed", changed, "expires", st.cert.Leaf.NotAfter)
	}
}

func (id *Identity) read() (caPEM, keyPEM []byte, err error) {
	if caPEM, err = os.ReadFile(id.files.CA); err != nil {
		return nil, nil, fmt.Errorf("reading the peer CA: %w", err)
	}
	if keyPEM, err = os.ReadFile(id.files.Key); err != nil {
		return nil, nil, fmt.Errorf("reading the peer CA key: %w", err)
	}
	return caPEM, keyPEM, nil
}

// load reads the CA files and mints a certificate with them.
func (id *Identity) load() (*state, error) {
	caPEM, keyPEM, err := id.read()
	if err != nil {
		return nil, err
	}
	cas, err := parseCerts(caPEM)
	if err != nil {
		return nil, fmt.Errorf("peer CA %s: %w", id.files.CA, err)
	}
	key, err := parseKey(keyPEM)
	if err != nil {
		return nil, fmt.Errorf("peer CA key %s: %w", id.files.Key, err)
	}
	var signer *x509.Certificate
	pool := x509.NewCertPool()
	for _, c := range cas {
		pool.AddCert(c)
		if pk, ok := key.Public().(interface{ Equal(crypto.PublicKey) bool }); ok && pk.Equal(c.PublicKey) {
			signer = c
		}
	}
	if signer == nil {
		return nil, fmt.Errorf("no CA certificate in %s matches the key in %s", id.files.CA, id.files.Key)
	}
	cert, err := mint(id.name, signer, key, id.lifetime)
	if err != nil {
		return nil, err
	}
	life := cert.Leaf.NotAfter.Sub(cert.Leaf.NotBefore) - clockSkew
	return &state{caPEM: caPEM, keyPEM: keyPEM, pool: pool, cert: cert,
		renewAt: cert.Leaf.NotAfter.Add(-life / 3)}, nil
}

// dnsName is a name that can also go in a certificate's DNS names (a
// Kubernetes node name is one).
var dnsName = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)

// mint makes a certificate for node, for both ends of a connection, signed
// by ca, valid for lifetime but not beyond ca.
func mint(node string, ca *x509.Certificate, caKey crypto.Signer, lifetime time.Duration) (*tls.Certificate, error) {
	if !ca.IsCA || ca.KeyUsage&x509.KeyUsageCertSign == 0 && ca.KeyUsage != 0 {
		return nil, fmt.Errorf("peer CA %q is not a CA that signs certificates", ca.Subject.CommonName)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: node},
		NotBefore:    now.Add(-clockSkew),
		NotAfter:     now.Add(lifetime),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	if tmpl.NotAfter.After(ca.NotAfter) {
		tmpl.NotAfter = ca.NotAfter
	}
	if !tmpl.NotAfter.After(now) {
		return nil, fmt.Errorf("peer CA %q expired at %s", ca.Subject.CommonName, ca.NotAfter)
	}
	if dnsName.MatchString(node) {
		tmpl.DNSNames = []string{node}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, key.Public(), caKey)
	if err != nil {
		return nil, fmt.Errorf("minting the peer certificate: %w", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return n
}

// ServerConfig is the chunk server's side: TLS 1.3 only, this node's
// current certificate, and a client certificate from the current CA
// bundle required of every peer.
func (id *Identity) ServerConfig() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			st := id.cur.Load()
			return &tls.Config{
				MinVersion:   tls.VersionTLS13,
				Certificates: []tls.Certificate{*st.cert},
				ClientAuth:   tls.RequireAndVerifyClientCert,
				ClientCAs:    st.pool,
			}, nil
		},
	}
}

// ClientConfig is the side of a node that asks a peer: TLS 1.3 only, this
// node's current certificate, and a server certificate from the current CA
// bundle required. Peers are dialled by address, which no certificate
// names, so the chain is verified here and the node name the certificate
// carries is for the caller to check against the member it asked
// (PeerName).
func (id *Identity) ClientConfig() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return id.cur.Load().cert, nil
		},
		// Not skipped: VerifyConnection verifies the chain against the
		// bundle of now, which a fixed RootCAs could not follow.
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return errors.New("peer TLS: the peer sent no certificate")
			}
			inter := x509.NewCertPool()
			for _, c := range cs.PeerCertificates[1:] {
				inter.AddCert(c)
			}
			_, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: id.cur.Load().pool, Intermediates: inter,
				KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
			if err != nil {
				return fmt.Errorf("peer TLS: %w", err)
			}
			return nil
		},
	}
}

// PeerName is the node name in the certificate the other end of a
// connection made with ServerConfig or ClientConfig presented, which the
// handshake verified; "" when there is none (not TLS).
func PeerName(cs *tls.ConnectionState) string {
	if cs == nil || len(cs.PeerCertificates) == 0 {
		return ""
	}
	return cs.PeerCertificates[0].Subject.CommonName
}

// NewCA makes a CA for a cluster's peers, named name and valid for
// lifetime: PEM certificate and PEM (PKCS #8) key.
func NewCA(name string, lifetime time.Duration) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(), Subject: pkix.Name{CommonName: name},
		NotBefore: now.Add(-clockSkew), NotAfter: now.Add(lifetime),
		IsCA: true, BasicConstraintsValid: true, MaxPathLenZero: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, nil, err
	}
	kb, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kb}), nil
}

// WriteCA makes a CA valid for ten years (NewCA) and writes it to dir as
// ca.crt and ca.key, for agents started outside the Helm chart, which
// makes its own.
func WriteCA(dir, name string) (Files, error) {
	cert, key, err := NewCA(name, 10*365*24*time.Hour)
	if err != nil {
		return Files{}, err
	}
	f := Files{CA: filepath.Join(dir, "ca.crt"), Key: filepath.Join(dir, "ca.key")}
	if err := os.WriteFile(f.CA, cert, 0o644); err != nil {
		return Files{}, err
	}
	if err := os.WriteFile(f.Key, key, 0o600); err != nil {
		return Files{}, err
	}
	return f, nil
}

func parseCerts(b []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for {
		var blk *pem.Block
		if blk, b = pem.Decode(b); blk == nil {
			break
		}
		if blk.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return nil, errors.New("no PEM certificate")
	}
	return out, nil
}

// parseKey reads a PEM key as openssl, cert-manager or Helm's genCA
// (PKCS #1 RSA) write it.
func parseKey(b []byte) (crypto.Signer, error) {
	for {
		var blk *pem.Block
		if blk, b = pem.Decode(b); blk == nil {
			return nil, errors.New("no PEM private key")
		}
		var k any
		var err error
		switch blk.Type {
		case "PRIVATE KEY":
			k, err = x509.ParsePKCS8PrivateKey(blk.Bytes)
		case "RSA PRIVATE KEY":
			k, err = x509.ParsePKCS1PrivateKey(blk.Bytes)
		case "EC PRIVATE KEY":
			k, err = x509.ParseECPrivateKey(blk.Bytes)
		default:
			continue
		}
		if err != nil {
			return nil, err
		}
		s, ok := k.(crypto.Signer)
		if !ok {
			return nil, fmt.Errorf("a %T cannot sign", k)
		}
		return s, nil
	}
}
