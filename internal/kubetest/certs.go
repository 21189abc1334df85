package kubetest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// pki is what the API server and its clients need: a CA that signs the
// serving certificate and the client certificates, and the key pair that
// signs service account tokens.
type pki struct {
	ca                          *x509.Certificate
	caSigner                    *ecdsa.PrivateKey
	caCert, caKey               []byte // PEM
	serveCert, serveKey         []byte
	adminCert, adminKey         []byte
	saPublic, saPrivate         []byte
	caFile                      string
	serveCertFile, serveKeyFile string
	saPublicFile, saKeyFile     string
}

// newPKI creates the certificates and keys and writes them into dir. The
// serving certificate names localhost, 127.0.0.1, the service IP of the
// kubernetes Service and each of hosts.
func newPKI(dir string, hosts []string) (*pki, error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "weightd-kubetest-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("creating the CA: %w", err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, err
	}
	p := &pki{ca: ca, caSigner: caKey, caCert: pemBlock("CERTIFICATE", caDER)}
	if p.caKey, err = ecKeyPEM(caKey); err != nil {
		return nil, err
	}

	serving := &x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-apiserver"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:    []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback, net.IPv4(10, 0, 0, 1)},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			serving.IPAddresses = append(serving.IPAddresses, ip)
		} else if h != "" {
			serving.DNSNames = append(serving.DNSNames, h)
		}
	}
	if p.serveCert, p.serveKey, err = p.sign(2, serving); err != nil {
		return nil, fmt.Errorf("creating the serving certificate: %w", err)
	}
	// The admin: a member of system:masters, which RBAC lets do anything.
	admin := &x509.Certificate{
		Subject:     pkix.Name{CommonName: "kubetest-admin", Organization: []string{"system:masters"}},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if p.adminCert, p.adminKey, err = p.sign(3, admin); err != nil {
		return nil, fmt.Errorf("creating the admin certificate: %w", err)
	}

	saKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	p.saPrivate = pemBlock("RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(saKey))
	pub, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return nil, err
	}
	p.saPublic = pemBlock("PUBLIC KEY", pub)

	p.caFile = filepath.Join(dir, "ca.crt")
	p.serveCertFile = filepath.Join(dir, "apiserver.crt")
	p.serveKeyFile = filepath.Join(dir, "apiserver.key")
	p.saPublicFile = filepath.Join(dir, "sa.pub")
	p.saKeyFile = filepath.Join(dir, "sa.key")
	for name, data := range map[string][]byte{
		p.caFile:        p.caCert,
		p.serveCertFile: p.serveCert,
		p.serveKeyFile:  p.serveKey,
		p.saPublicFile:  p.saPublic,
		p.saKeyFile:     p.saPrivate,
	} {
		if err := os.WriteFile(name, data, 0o600); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// sign issues a certificate from tmpl, with a new key, signed by the CA.
func (p *pki) sign(serial int64, tmpl *x509.Certificate) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	tmpl.SerialNumber = big.NewInt(serial)
	tmpl.NotBefore = now.Add(-time.Hour)
	tmpl.NotAfter = now.Add(10 * 365 * 24 * time.Hour)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &key.PublicKey, p.caSigner)
	if err != nil {
		return nil, nil, err
	}
	keyPEM, err = ecKeyPEM(key)
	return pemBlock("CERTIFICATE", der), keyPEM, err
}

// clientCert issues a client certificate for user in groups, as the API
// server's x509 authenticator reads them (CN and O).
func (p *pki) clientCert(user string, groups []string) (certPEM, keyPEM []byte, err error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return nil, nil, err
	}
	return p.sign(serial.Int64()+4, &x509.Certificate{
		Subject:     pkix.Name{CommonName: user, Organization: groups},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
}

func pemBlock(typ string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
}

func ecKeyPEM(k *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		return nil, err
	}
	return pemBlock("EC PRIVATE KEY", der), nil
}
